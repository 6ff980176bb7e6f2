#!/usr/bin/env bash
# The OpenAI HTTP API driven by the official `openai` npm client (pinned
# 6.49.0, installed once into $EXL3_BUILD_DIR/npm-openai): tests/cli/openai_client.cjs
# against (1) `serve --tp 2 --http-port 0` on the Qwen3 demo model (real
# tokenizer and chat template; bearer token; --max-running 1 --max-queue 1 so a
# third request meets a full queue) — models, chat and completions streamed and
# not, finalChatCompletion, include_usage, logprobs, seeds, 400 (not retried) /
# 401 / 404 / 413 / 429 / 501, break -> abort seen in /metrics — and (2) the
# scripted engine of tests/http (tool-call round trip, reasoning split, n,
# 503). Afterwards GetServerInfo (gRPC) shows nothing running.
# Without node >= 20, npm or the registry: SKIP (exit 77).
set -uo pipefail
BIN=$1
SRC=${EXL3_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
BUILD=${EXL3_BUILD_DIR:-$(dirname "$(dirname "$BIN")")}
WORK=$(mktemp -d)
source "$SRC/tests/cli/lib/serve.sh"
SCRIPTED_PID=""
cleanup() {
  serve_stop >/dev/null 2>&1
  [ -n "$SCRIPTED_PID" ] && kill -TERM "$SCRIPTED_PID" 2>/dev/null && wait "$SCRIPTED_PID" 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; [ -n "${LOG:-}" ] && [ -f "$LOG" ] && tail -20 "$LOG"; exit 1; }

command -v node >/dev/null && command -v npm >/dev/null || { echo "SKIP: node and npm are needed"; exit 77; }
[ "$(node -p 'process.versions.node.split(".")[0]')" -ge 20 ] || { echo "SKIP: openai@6 needs Node 20"; exit 77; }
NPM_DIR=$BUILD/npm-openai
if ! (flock 9
      [ "$(node -p "require('$NPM_DIR/node_modules/openai/package.json').version" 2>/dev/null)" = 6.49.0 ] ||
        npm install --prefix "$NPM_DIR" --no-audit --no-fund --loglevel=error openai@6.49.0 >"$WORK/npm.log" 2>&1
     ) 9>"$BUILD/.npm-openai.lock"; then
  cat "$WORK/npm.log"; echo "SKIP: could not install openai@6.49.0 from npm (no registry?)"; exit 77
fi
TOK=$BUILD/demo-tokenizer
if ! (flock 9; bash "$SRC/scripts/fetch-demo-tokenizer.sh" "$TOK" >"$WORK/fetch.log" 2>&1) 9>"$BUILD/.demo-tokenizer.lock"; then
  cat "$WORK/fetch.log"; echo "SKIP: could not fetch the Qwen3 tokenizer (no network?)"; exit 77
fi
SCRIPTED=$BUILD/tests/http_scripted_server
[ -x "$SCRIPTED" ] || fail "$SCRIPTED not built"

"$BIN" make-demo-model --arch qwen3 --hidden 128 --intermediate 384 --out "$WORK/qwen3" \
  --tokenizer-dir "$TOK" >/dev/null || fail "make-demo-model"
echo "test-token-$RANDOM" >"$WORK/token"
SERVE_CLIENT_FLAGS="--token-file $WORK/token"
serve_start "$WORK/qwen3" --tp 2 --http-port 0 --auth-token-file "$WORK/token" --max-running 1 --max-queue 1
HTTP=$(sed -n 's/^http: listening on //p' "$LOG")
[ -n "$HTTP" ] || fail "no 'http: listening on' line"

"$SCRIPTED" >"$WORK/scripted.log" 2>&1 &
SCRIPTED_PID=$!
SHTTP=""
for _ in $(seq 100); do
  SHTTP=$(sed -n 's/^http: listening on //p' "$WORK/scripted.log")
  [ -n "$SHTTP" ] && break
  sleep 0.1
done
[ -n "$SHTTP" ] || fail "scripted server did not start: $(cat "$WORK/scripted.log")"

NODE_PATH=$NPM_DIR/node_modules timeout 600 node "$SRC/tests/cli/openai_client.cjs" \
  "http://$HTTP/v1" "http://$SHTTP/v1" "$(cat "$WORK/token")" "$SCRIPTED_PID" || fail "openai client checks"

# The aborted streams left nothing running (gRPC GetServerInfo).
"$BIN" client --addr "$ADDR" --token-file "$WORK/token" --info >"$WORK/info.json" 2>&1 ||
  fail "GetServerInfo: $(cat "$WORK/info.json")"
# proto3 JSON leaves out zeros: a running or waiting count here is a leak.
if grep -Eq '"(numRequestsRunning|num_requests_running|numRequestsWaiting|num_requests_waiting)": *[1-9]' "$WORK/info.json"; then
  fail "requests left running after the clients went away: $(cat "$WORK/info.json")"
fi
echo "PASS"
