#!/usr/bin/env bash
# Speculative decoding end to end through the gRPC API (issue 18): with
# n-gram drafts (`serve --speculative ngram`) every stream gets exactly the
# tokens it gets without drafts —
#   * alone (one request at a time) and in a batch of 32 at once,
#   * greedy and seeded sampling with penalties,
#   * at TP = 1 and 2; at TP 1 (and EP 2) with a KV pool small enough that the
#     batch preempts; at TP 2 through a SIGKILL of a rank mid-stream and the
#     replay on the re-formed group (a pool that holds every stream, so all
#     are still running when the rank dies),
#   * for every test architecture: qwen3 (above), llama at TP 2, and the MoE
#     models qwen3-moe and mixtral at EP 2 (experts split across the ranks),
#   * on real text (stories260K from ../shared, its tokenizer; unquantized and
#     EXL3 4 bpw with serve's default int8 decode activations, TP 2): prompts
#     that quote a paragraph twice, so the model copies it and long runs are
#     accepted; greedy and seeded; with a stop string that falls inside an
#     accepted run — the text, the finish reason and the matched stop equal
#     the undrafted server's; the 4 bpw model also drafted by a draft model
#     (--speculative draft, the unquantized model as the draft),
# and the drafts really ran: GetServerInfo counts drafts and accepted tokens.
#
# The references are each stream run alone without drafts on the same
# configuration (replay_client.py refs, prompts that repeat a span:
# --repetitive); drafting must reproduce them token for token. (Across TP
# sizes logits differ in the last bits — all-reduce order — so a seeded draw
# can differ between TP 1 and TP 2 with or without drafts: seeded_sampling_test.sh
# covers that comparison and its odds.)
#
# Readiness is a handshake (lib/serve.sh); a trap stops the server and every
# rank on any exit. Needs /usr/bin/python3 with grpcio and the stubs in
# $EXL3_BUILD_DIR/python (else exit 77 = skip).
set -uo pipefail
BIN=$1
SRC=${EXL3_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
source "$SRC/tests/cli/lib/serve.sh"
serve_test_setup --repetitive  # BUILD, WORK, the cleanup trap, fail, the Python skip, py

STREAMS=32
TOKENS=96
# 56 pages of 16 = 896 positions: 32 streams of up to ~160 positions preempt.
SMALL=(--kv-pages 56 --shutdown-grace-ms 2000)
BIG=(--kv-pages 600 --shutdown-grace-ms 2000)
SPEC=(--speculative ngram --draft-tokens 6 --no-draft-governor)  # draft whenever possible: coverage
"$BIN" make-test-model --arch qwen3 --out "$WORK/dense" >/dev/null || fail "make-test-model qwen3"
"$BIN" make-test-model --arch qwen3-moe --out "$WORK/moe" >/dev/null || fail "make-test-model qwen3-moe"
for arch in llama mixtral; do
  "$BIN" make-test-model --arch $arch --out "$WORK/$arch" >/dev/null || fail "make-test-model $arch"
done

for model in dense moe llama mixtral; do
  case $model in
    dense) configs=("--tp 1" "--tp 2") ;;
    llama) configs=("--tp 2 --no-kill") ;;
    *) configs=("--tp 2 --ep 2") ;;
  esac
  for config_spec in "${configs[@]}"; do
    config=${config_spec% --no-kill}  # llama: TP 2 without the kill (dense covers it)
    tag0="$model $config"
    # References: the same configuration without drafts, each stream alone.
    # shellcheck disable=SC2086  # config is a word list
    serve_start "$WORK/$model" $config "${BIG[@]}"
    for mode in greedy sampled; do
      flag=(); [ $mode = sampled ] && flag=(--sampled)
      py "${flag[@]}" refs --out "$WORK/$model-$mode.json" --streams $STREAMS --max-tokens $TOKENS ||
        fail "$tag0 $mode refs"
    done
    serve_stop || fail "serve $tag0 exited non-zero"

    pool=("${SMALL[@]}"); preemptions=1
    [ "$config" = "--tp 2" ] && { pool=("${BIG[@]}"); preemptions=0; }
    # shellcheck disable=SC2086  # config is a word list
    serve_start "$WORK/$model" $config "${SPEC[@]}" "${pool[@]}"
    for mode in greedy sampled; do
      flag=(); [ $mode = sampled ] && flag=(--sampled)
      tag="$tag0 $mode"
      py "${flag[@]}" refs --out "$WORK/$model-$mode-spec.json" --streams $STREAMS --max-tokens $TOKENS ||
        fail "$tag: drafted alone"
      py same "$WORK/$model-$mode.json" "$WORK/$model-$mode-spec.json" || fail "$tag: drafted alone != serial"
      victim=0
      if [ "$config_spec" = "--tp 2" ]; then victim=$(pgrep -P "$SERVER_PID" -f worker | tail -1); fi
      py "${flag[@]}" streams --refs "$WORK/$model-$mode.json" --kill-pid "$victim" --expect same ||
        fail "$tag: drafted batch of $STREAMS (kill $victim) != serial"
      if [ "$victim" != 0 ]; then
        "$BIN" client --addr "$ADDR" --health --wait-ready-ms 120000 >/dev/null ||
          fail "$tag: not ready after the replay"
      fi
    done
    replays=0; [ "$config_spec" = "--tp 2" ] && replays=1
    py info --ready 1 --min-replays $replays --min-preemptions $preemptions --min-drafts 1 --min-accepted 1 ||
      fail "$tag0: drafting did not happen as required"
    serve_stop || fail "serve $tag0 --speculative exited non-zero"
  done
done

# Real text: stories260K, text prompts through the server's tokenizer.
SHARED=${EXL3_SHARED_DIR:-$SRC/../shared}
STORIES=$SHARED/models/stories260K
TEXT=$SHARED/testdata/text/tinystories_valid_first1000.txt
if [ -f "$STORIES/stories260K.bin" ] && [ -f "$TEXT" ]; then
  "$BIN" import-llama2c --in "$STORIES/stories260K.bin" --tokenizer "$STORIES/tok512.bin" \
    --out "$WORK/stories" >/dev/null || fail "import stories260K"
  "$BIN" convert --in "$WORK/stories" --out "$WORK/stories-q4" --bits 4 --threads 2 --no-progress \
    >/dev/null || fail "convert stories260K"
  # Four paragraphs, each quoted twice then started again; a stop word from
  # its middle (reached while the model copies).
  /usr/bin/python3 - "$TEXT" "$WORK" <<'PY' || fail "prompts"
import sys
stories = [s.strip() for s in open(sys.argv[1]).read().split("<|endoftext|>") if len(s.strip()) > 200]
with open(f"{sys.argv[2]}/stories-prompts.txt", "w") as f:
    for s in stories[:4]:
        p = " ".join(s[:200].split()[:-1])
        words = p.split()
        f.write(f"{p}\t{' '.join(words[:5])}\t{words[12].strip('.,!?')}\n")
PY
  run_stories() {  # OUT SERVE-FLAGS...: every prompt's text and finish, greedy and seeded, with and without a stop
    local out=$1
    shift
    : >"$out"
    while IFS=$'\t' read -r para start stop; do
      prompt="$para

$para

$start"
      for sampling in "--temperature 0" "--temperature 0.8 --top-k 40 --seed 11"; do
        for stops in "" "--stop $stop"; do
          # shellcheck disable=SC2086  # word lists
          "$BIN" client --addr "$ADDR" --prompt "$prompt" --max-tokens 48 $sampling $stops \
            >"$WORK/text.out" 2>"$WORK/text.err" || fail "client on $*"
          { cat "$WORK/text.out"; echo; grep -o 'finish [^,]*' "$WORK/text.err"; } >>"$out"
        done
      done
    done <"$WORK/stories-prompts.txt"
  }
  for model in stories stories-q4; do
    serve_start "$WORK/$model" --tp 2 --shutdown-grace-ms 2000
    run_stories "$WORK/$model-off.txt"
    serve_stop || fail "serve $model exited non-zero"
    serve_start "$WORK/$model" --tp 2 "${SPEC[@]}" --shutdown-grace-ms 2000
    run_stories "$WORK/$model-spec.txt"
    py info --min-drafts 1 --min-accepted 16 || fail "$model: the copied paragraphs were not drafted"
    serve_stop || fail "serve $model --speculative exited non-zero"
    diff "$WORK/$model-off.txt" "$WORK/$model-spec.txt" >"$WORK/diff.log" ||
      { cat "$WORK/diff.log"; fail "$model: drafted text != undrafted text"; }
    if [ $model = stories-q4 ]; then
      # A draft model: the 4 bpw model drafted by the unquantized one.
      serve_start "$WORK/$model" --tp 2 --speculative draft --draft-model "$WORK/stories" \
        --draft-tokens 4 --no-draft-governor --shutdown-grace-ms 2000
      run_stories "$WORK/$model-draft.txt"
      py info --min-drafts 1 --min-accepted 16 || fail "$model: the draft model's drafts were not accepted"
      serve_stop || fail "serve $model --speculative draft exited non-zero"
      diff "$WORK/$model-off.txt" "$WORK/$model-draft.txt" >"$WORK/diff.log" ||
        { cat "$WORK/diff.log"; fail "$model: text drafted by a draft model != undrafted text"; }
      echo "$model (tp 2) drafted by the unquantized model: text == undrafted"
    fi
    grep -c 'finish stop_string' "$WORK/$model-spec.txt" | grep -qv '^0$' ||
      fail "$model: no stop string was reached (the test would not cover it)"
    echo "$model (tp 2): drafted text, finish reasons and stops == undrafted ($(grep -c finish "$WORK/$model-spec.txt") requests)"
  done
else
  echo "note: $STORIES not found (../shared); the real-text part is skipped"
fi
echo "speculative_serve: OK"
