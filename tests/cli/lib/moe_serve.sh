# tests/cli/lib/moe_serve.sh — the body of glm4_moe_serve_test.sh and
# deepseek_v3_serve_test.sh (their headers say what it shows): source it with
# ARCH set to the make-test-model / make-demo-model architecture and the
# test's arguments ($1 = the exl3serve binary).
set -uo pipefail
BIN=$1
SRC=${EXL3_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
source "$SRC/tests/cli/lib/serve.sh"
serve_test_setup --repetitive  # BUILD, WORK, the cleanup trap, fail, the Python skip, py

STREAMS=16
TOKENS=32
EXTRA=(--kv-pages 600 --shutdown-grace-ms 2000)
SPEC=(--speculative ngram --draft-tokens 6 --no-draft-governor)  # draft whenever possible
SHAPE=(--hidden 128 --intermediate 128 --experts 8 --layers 2)  # layer 0 dense, layer 1 MoE
TOK=$BUILD/demo-tokenizer
tok=(--no-tokenizer)
[ -f "$TOK/tokenizer.json" ] && [ -f "$TOK/tokenizer_config.json" ] && tok=(--tokenizer-dir "$TOK")
"$BIN" make-demo-model --arch "$ARCH" "${SHAPE[@]}" "${tok[@]}" --out "$WORK/demo-hf" >/dev/null ||
  fail "make-demo-model --arch $ARCH"
"$BIN" make-test-model --arch "$ARCH" "${SHAPE[@]}" --out "$WORK/test" >/dev/null ||
  fail "make-test-model --arch $ARCH"
t0=$(date +%s)
"$BIN" convert --in "$WORK/demo-hf" --out "$WORK/demo" --bits 3 --head-bits 16 --threads 2 \
  --no-progress >"$WORK/convert.txt" 2>&1 || fail "convert the demo model"
echo "convert demo: $(($(date +%s) - t0)) s"

text() {  # the demo model's text for one prompt (greedy)
  "$BIN" client --addr "$ADDR" --prompt "The weather today" --max-tokens 16 --temperature 0 2>/dev/null
}

for m in demo test; do
  modes=(greedy); [ $m = test ] && modes=(greedy sampled)
  # The demo model is EXL3: its decode linears run at int8 activations by
  # default, with one scale per 128-row block of k — layout-invariant only
  # where TP splits on 128-channel boundaries, and these demo shapes split
  # heads of 48 (GLM) and 20 (DeepSeek v) channels mid-block, so a
  # row-parallel linear under TP 2 rounds its input differently from TP 1
  # (with the older per-row scale, 2 of 16 greedy streams parted from TP 1 on
  # an AMD Zen 5 guest; at fp32 decode they are equal; the int8 invariance on
  # aligned shapes is tensor_parallel_test's Int8Decode*). Layouts are
  # compared at fp32 decode;
  # batched == alone within a layout is exact at either precision (the
  # worker tests and the other serve tests check int8).
  PREC=(); [ $m = demo ] && PREC=(--decode-precision fp32)
  # TP 1: the references, each stream alone; then all at once.
  serve_start "$WORK/$m" --tp 1 "${PREC[@]}" "${EXTRA[@]}"
  for mode in "${modes[@]}"; do
    flag=(); [ $mode = sampled ] && flag=(--sampled)
    py "${flag[@]}" refs --out "$WORK/$m-$mode.json" --streams $STREAMS --max-tokens $TOKENS || fail "$m tp1 $mode refs"
    py "${flag[@]}" streams --refs "$WORK/$m-$mode.json" --kill-pid 0 --expect same || fail "$m tp1 $mode batch"
  done
  [ $m = demo ] && [ "${tok[0]}" != --no-tokenizer ] && { text >"$WORK/text-tp1.txt" || fail "demo tp1 text"; }
  serve_stop || fail "serve $m --tp 1 exited non-zero"

  # TP 2 x EP 2: alone and batched equal TP 1.
  serve_start "$WORK/$m" --tp 2 --ep 2 "${PREC[@]}" "${EXTRA[@]}"
  for mode in "${modes[@]}"; do
    flag=(); [ $mode = sampled ] && flag=(--sampled)
    py "${flag[@]}" refs --out "$WORK/$m-$mode-ep.json" --streams $STREAMS --max-tokens $TOKENS || fail "$m ep2 $mode refs"
    py same "$WORK/$m-$mode.json" "$WORK/$m-$mode-ep.json" || fail "$m tp2 x ep2 $mode alone != tp1"
    py "${flag[@]}" streams --refs "$WORK/$m-$mode.json" --kill-pid 0 --expect same || fail "$m tp2 x ep2 $mode batch != tp1"
  done
  if [ $m = demo ] && [ "${tok[0]}" != --no-tokenizer ]; then
    text >"$WORK/text-ep.txt" || fail "demo ep2 text"
    cmp -s "$WORK/text-tp1.txt" "$WORK/text-ep.txt" ||
      fail "demo text: tp2 x ep2 '$(cat "$WORK/text-ep.txt")' != tp1 '$(cat "$WORK/text-tp1.txt")'"
    [ -s "$WORK/text-ep.txt" ] || fail "demo text is empty"
    echo "demo text (tp 1 == tp 2 x ep 2):$(cat "$WORK/text-ep.txt")"
  fi
  serve_stop || fail "serve $m --tp 2 --ep 2 exited non-zero"

  # TP 2 x EP 2 with n-gram drafts: equal to the undrafted references of the
  # same configuration (the *-ep.json files). The test model only: the demo
  # model's peaked successor function does not repeat within the streams, so
  # n-gram drafts never apply there.
  [ $m = demo ] && continue
  serve_start "$WORK/$m" --tp 2 --ep 2 "${SPEC[@]}" "${EXTRA[@]}"
  for mode in "${modes[@]}"; do
    flag=(); [ $mode = sampled ] && flag=(--sampled)
    py "${flag[@]}" refs --out "$WORK/$m-$mode-spec.json" --streams $STREAMS --max-tokens $TOKENS || fail "$m spec $mode refs"
    py same "$WORK/$m-$mode-ep.json" "$WORK/$m-$mode-spec.json" || fail "$m tp2 x ep2 $mode: drafted alone != undrafted"
    py "${flag[@]}" streams --refs "$WORK/$m-$mode-ep.json" --kill-pid 0 --expect same ||
      fail "$m tp2 x ep2 $mode: drafted batch != undrafted"
  done
  py info --ready 1 --min-drafts 1 --min-accepted 1 || fail "$m: drafting did not happen"
  serve_stop || fail "serve $m --speculative exited non-zero"
done

# The test model's sampled streams really sample (a sampler stuck on the
# arg-max would pass the comparisons above).
/usr/bin/python3 - "$WORK/test-greedy.json" "$WORK/test-sampled.json" <<'PY' || fail "sampling is not sampling"
import json, sys
g, s = (json.load(open(f))["refs"] for f in sys.argv[1:])
differ = sum(a["ids"] != b["ids"] for a, b in zip(g, s))
print(f"test model: sampled vs greedy: {differ} of {len(g)} streams differ")
sys.exit(0 if differ >= len(g) // 2 else 1)
PY
echo "${ARCH}_serve: OK"
