#!/usr/bin/env bash
# Rank-side sampling end to end through the gRPC API (issue: sampling on the
# ranks): seeded sampling (temperature 0.8, top-p 0.9, top-k 50, repetition /
# presence / frequency penalties) and greedy decoding give the same tokens
#   * for a request alone and inside a batch of all streams at once,
#   * at TP = 1, 2 and 3 (vocabulary-parallel sampling over 1, 2, 3 slices),
#   * after kill -9 of a rank and the replay on a re-formed group (TP = 2),
#   * for MoE models at TP = 1 and EP = 2 (Qwen3-MoE, Mixtral), Llama at TP 2;
# and greedy serving equals `exl3serve generate` (full logits, the float64
# reference sampler) on the same prompt.
#
# The references are each stream run alone at TP = 1 (replay_client.py refs);
# every other configuration must reproduce them exactly. Logits differ in the
# last bits between TP sizes (all-reduce order), so a sampled token could in
# principle differ when its uniform falls within ~1e-6 of an interval edge;
# with 16 x 32 draws per configuration that chance is ~1e-3 in all.
#
# Readiness is a handshake ("listening on", then health until SERVING); a
# trap stops the server and every rank on any exit. Needs /usr/bin/python3
# with grpcio and the stubs in $EXL3_BUILD_DIR/python (else exit 77 = skip).
set -uo pipefail
BIN=$1
SRC=${EXL3_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
source "$SRC/tests/cli/lib/serve.sh"
# shellcheck disable=SC2119  # no client flags
serve_test_setup  # BUILD, WORK, the cleanup trap, fail, the Python skip, py

EXTRA=(--kv-pages 600 --shutdown-grace-ms 2000)
STREAMS=16
TOKENS=32
"$BIN" make-test-model --arch qwen3 --out "$WORK/dense" >/dev/null || fail "make-test-model qwen3"
"$BIN" make-test-model --arch qwen3-moe --out "$WORK/moe" >/dev/null || fail "make-test-model qwen3-moe"

# TP = 1: the references (alone), then all at once.
serve_start "$WORK/dense" --tp 1 "${EXTRA[@]}"
for mode in greedy sampled; do
  flag=(); [ $mode = sampled ] && flag=(--sampled)
  py "${flag[@]}" refs --out "$WORK/$mode.json" --streams $STREAMS --max-tokens $TOKENS || fail "tp1 $mode refs"
  py "${flag[@]}" streams --refs "$WORK/$mode.json" --kill-pid 0 --expect same || fail "tp1 $mode batch"
done
serve_stop || fail "serve --tp 1 exited non-zero"
# The sampled streams really sample (a sampler stuck on the arg-max would pass the rest).
/usr/bin/python3 - "$WORK/greedy.json" "$WORK/sampled.json" <<'PY' || fail "sampling is not sampling"
import json, sys
g, s = (json.load(open(f))["refs"] for f in sys.argv[1:])
differ = sum(a["ids"] != b["ids"] for a, b in zip(g, s))
distinct = len({tuple(r["ids"]) for r in s})
print(f"sampled vs greedy: {differ} of {len(g)} streams differ, {distinct} distinct sampled outputs")
sys.exit(0 if differ >= len(g) * 3 // 4 and distinct == len(s) else 1)
PY

# Greedy serving equals generate (full logits + the reference sampler).
prompt=$(/usr/bin/python3 -c "import json; print(','.join(map(str, json.load(open('$WORK/greedy.json'))['refs'][0]['prompt'])))")
want=$(/usr/bin/python3 -c "import json; print(' '.join(map(str, json.load(open('$WORK/greedy.json'))['refs'][0]['ids'])))")
got=$("$BIN" --log-level warning generate --model "$WORK/dense" --prompt-ids "$prompt" --temperature 0 \
      --ids --max-tokens $TOKENS --ignore-eos) || fail "generate"
[ "$got" = "$want" ] || fail "generate greedy '$got' != served greedy '$want'"
echo "generate == serve (greedy, $TOKENS tokens)"
want=$(/usr/bin/python3 -c "import json; print(' '.join(map(str, json.load(open('$WORK/sampled.json'))['refs'][0]['ids'])))")
got=$("$BIN" --log-level warning generate --model "$WORK/dense" --prompt-ids "$prompt" --temperature 0.8 \
      --top-p 0.9 --top-k 50 --repetition-penalty 1.1 --presence-penalty 0.3 --frequency-penalty 0.2 \
      --seed 1000 --ids --max-tokens $TOKENS --ignore-eos) || fail "generate sampled"
[ "$got" = "$want" ] || fail "generate sampled '$got' != served sampled '$want'"
echo "generate == serve (seeded sampling, float64 reference vs the ranks' sampler)"

for tp in 2 3; do
  serve_start "$WORK/dense" --tp $tp "${EXTRA[@]}"
  for mode in greedy sampled; do
    flag=(); [ $mode = sampled ] && flag=(--sampled)
    py "${flag[@]}" refs --out "$WORK/$mode-tp$tp.json" --streams $STREAMS --max-tokens $TOKENS ||
      fail "tp$tp $mode refs"
    py same "$WORK/$mode.json" "$WORK/$mode-tp$tp.json" || fail "tp$tp $mode alone != tp1"
    victim=0
    if [ $tp = 2 ]; then victim=$(pgrep -P "$SERVER_PID" -f worker | tail -1); fi
    py "${flag[@]}" streams --refs "$WORK/$mode.json" --kill-pid "$victim" --expect same ||
      fail "tp$tp $mode batch (kill $victim)"
    [ "$victim" != 0 ] && { "$BIN" client --addr "$ADDR" --health --wait-ready-ms 120000 >/dev/null ||
                            fail "tp$tp: not ready after the replay"; }
  done
  [ $tp = 2 ] && { py info --ready 1 --min-replays 1 || fail "tp2: no replay recorded"; }
  serve_stop || fail "serve --tp $tp exited non-zero"
done

# MoE: TP = 1 alone vs EP = 2 in a batch.
serve_start "$WORK/moe" --tp 1 "${EXTRA[@]}"
for mode in greedy sampled; do
  flag=(); [ $mode = sampled ] && flag=(--sampled)
  py "${flag[@]}" refs --out "$WORK/moe-$mode.json" --streams $STREAMS --max-tokens $TOKENS || fail "moe $mode refs"
done
serve_stop || fail "serve moe --tp 1"
serve_start "$WORK/moe" --tp 2 --ep 2 "${EXTRA[@]}"
for mode in greedy sampled; do
  flag=(); [ $mode = sampled ] && flag=(--sampled)
  py "${flag[@]}" streams --refs "$WORK/moe-$mode.json" --kill-pid 0 --expect same || fail "moe ep2 $mode"
done
serve_stop || fail "serve moe --ep 2"

# Greedy and sampled on the other test architectures: Llama at TP 1 vs TP 2,
# Mixtral at TP 1 vs EP 2 (experts split across the ranks).
for arch in llama mixtral; do
  "$BIN" make-test-model --arch $arch --out "$WORK/$arch" >/dev/null || fail "make-test-model $arch"
  serve_start "$WORK/$arch" --tp 1 "${EXTRA[@]}"
  for mode in greedy sampled; do
    flag=(); [ $mode = sampled ] && flag=(--sampled)
    py "${flag[@]}" refs --out "$WORK/$arch-$mode.json" --streams 8 --max-tokens $TOKENS || fail "$arch $mode refs"
  done
  serve_stop || fail "serve $arch --tp 1"
  if [ $arch = llama ]; then serve_start "$WORK/$arch" --tp 2 "${EXTRA[@]}"; else serve_start "$WORK/$arch" --tp 2 --ep 2 "${EXTRA[@]}"; fi
  for mode in greedy sampled; do
    flag=(); [ $mode = sampled ] && flag=(--sampled)
    py "${flag[@]}" streams --refs "$WORK/$arch-$mode.json" --kill-pid 0 --expect same || fail "$arch $mode x2"
  done
  serve_stop || fail "serve $arch x2"
done
echo "seeded_sampling: OK"
