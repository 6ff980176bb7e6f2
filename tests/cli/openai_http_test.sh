#!/usr/bin/env bash
# The OpenAI HTTP API at the byte level with curl, on a real trained model:
# stories260K (../shared, imported with its tokenizer) on a 2-rank cluster
# (`serve --tp 2 --http-port 0`) answers /v1/completions in English; the same
# prompt through HTTP and gRPC gives the same token ids (greedy and seeded);
# SSE framing checked byte for byte (data: lines, blank-line separators,
# role-less text chunks, finish_reason on the last, usage chunk, [DONE],
# headers); malformed bodies (bad JSON, wrong types, unknown fields, a 10 MB
# body, wrong method/path) get OpenAI error bodies with the right status;
# /tokenize and /detokenize round-trip; /health; /metrics passes promtool and
# carries the HTTP series; a curl killed mid-stream aborts its request.
set -uo pipefail
BIN=$1
SRC=${EXL3_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
BUILD=${EXL3_BUILD_DIR:-$(dirname "$(dirname "$BIN")")}
SHARED=${EXL3_SHARED_DIR:-$SRC/../shared}
STORIES=$SHARED/models/stories260K
[ -f "$STORIES/stories260K.bin" ] || { echo "SKIP: $STORIES not found"; exit 77; }
command -v curl >/dev/null || { echo "SKIP: curl not installed"; exit 77; }
WORK=$(mktemp -d)
source "$SRC/tests/cli/lib/serve.sh"
CURL_PID=""
cleanup() {
  [ -n "$CURL_PID" ] && kill "$CURL_PID" 2>/dev/null
  serve_stop >/dev/null 2>&1
  rm -rf "$WORK"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; [ -n "${LOG:-}" ] && [ -f "$LOG" ] && tail -20 "$LOG"; exit 1; }

"$BIN" import-llama2c --in "$STORIES/stories260K.bin" --tokenizer "$STORIES/tok512.bin" --out "$WORK/stories" \
  >/dev/null || fail "import"
serve_start "$WORK/stories" --tp 2 --http-port 0
HTTP=$(sed -n 's/^http: listening on //p' "$LOG")
[ -n "$HTTP" ] || fail "no 'http: listening on' line"
URL=http://$HTTP
post() { curl -s -o "$WORK/body" -w '%{http_code}' -H 'Content-Type: application/json' "$@"; }

# --- English from a real model, and the same ids as gRPC ---------------------------
for sampling in '"temperature":0' '"temperature":0.8,"seed":42'; do
  code=$(post -d "{\"model\":\"stories\",\"prompt\":\"Once upon a time\",\"max_tokens\":32,$sampling,\"return_token_ids\":true}" "$URL/v1/completions")
  [ "$code" = 200 ] || fail "completions ($sampling): HTTP $code $(cat "$WORK/body")"
  http_ids=$(python3 -c 'import json, sys; print(" ".join(map(str, json.load(open(sys.argv[1]))["choices"][0]["token_ids"])))' "$WORK/body")
  text=$(python3 -c 'import json, sys; print(json.dumps(json.load(open(sys.argv[1]))["choices"][0]["text"]))' "$WORK/body")
  flags=(--temperature 0)
  [[ $sampling == *seed* ]] && flags=(--temperature 0.8 --seed 42)
  grpc_ids=$("$BIN" client --addr "$ADDR" --prompt "Once upon a time" --add-special-tokens --max-tokens 32 --ids \
    "${flags[@]}" 2>/dev/null)
  [ "$http_ids" = "$grpc_ids" ] || fail "HTTP ids != gRPC ids ($sampling): [$http_ids] vs [$grpc_ids]"
  echo "completions ($sampling): $text"
done
# Greedy stories260K continues in English: mostly dictionary-like lower-case words.
python3 - "$WORK/body" <<'PY' || fail "not English: $(cat "$WORK/body")"
import json, re, sys
text = json.load(open(sys.argv[1]))["choices"][0]["text"]
words = re.findall(r"[A-Za-z]+", text)
common = {"the", "a", "was", "and", "to", "she", "he", "they", "her", "his", "it", "in", "of", "with", "little", "day", "time", "there", "big", "had", "saw", "said", "one", "very"}
assert len(words) >= 12, words
assert sum(w.lower() in common for w in words) >= 4, words
PY
code=$(post -d '{"prompt":"Once upon a time","max_tokens":24,"temperature":0}' "$URL/v1/completions")
cp "$WORK/body" "$WORK/greedy.json"

# --- SSE framing, byte for byte ---------------------------------------------------
curl -sN -D "$WORK/headers" -H 'Content-Type: application/json' \
  -d '{"prompt":"Once upon a time","max_tokens":24,"temperature":0,"stream":true,"stream_options":{"include_usage":true}}' \
  "$URL/v1/completions" >"$WORK/stream.sse" || fail "stream"
grep -qi '^content-type: text/event-stream' "$WORK/headers" || fail "content-type: $(cat "$WORK/headers")"
grep -qi '^transfer-encoding: chunked' "$WORK/headers" || fail "not chunked"
python3 - "$WORK/stream.sse" "$WORK/greedy.json" <<'PY' || fail "SSE framing"
import json, sys
raw = open(sys.argv[1], "rb").read()
assert b"\r" not in raw, "no CR in events"
assert raw.endswith(b"data: [DONE]\n\n"), raw[-40:]
events = raw.decode().split("\n\n")
assert events[-1] == "", "the stream ends with a blank line"
events = events[:-1]
for e in events:
    assert e.startswith("data: ") and "\n" not in e, repr(e)
payloads = [e[6:] for e in events]
assert payloads[-1] == "[DONE]"
chunks = [json.loads(p) for p in payloads[:-1]]
ids = {c["id"] for c in chunks}
assert len(ids) == 1 and next(iter(ids)).startswith("cmpl-"), ids
assert all(c["object"] == "text_completion" for c in chunks)
usage = chunks[-1]
assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 24, usage
body = chunks[:-1]
assert all(len(c["choices"]) == 1 for c in body)
assert all(c["choices"][0]["finish_reason"] is None for c in body[:-1])
assert body[-1]["choices"][0]["finish_reason"] == "length", body[-1]
text = "".join(c["choices"][0]["text"] for c in body)
whole = json.load(open(sys.argv[2]))
assert text == whole["choices"][0]["text"], (text, whole["choices"][0]["text"])
assert whole["usage"]["prompt_tokens"] == usage["usage"]["prompt_tokens"]
print("sse: %d events, text == non-stream" % len(events))
PY

# --- Malformed bodies ---------------------------------------------------------------
check_error() {  # STATUS PARAM(or -) CURL-ARGS...
  local want=$1 param=$2
  shift 2
  local code
  code=$(post "$@")
  [ "$code" = "$want" ] || fail "want HTTP $want, got $code for $*: $(head -c 300 "$WORK/body")"
  python3 - "$WORK/body" "$param" <<'PY' || fail "error body for $*: $(head -c 300 "$WORK/body")"
import json, sys
e = json.load(open(sys.argv[1]))["error"]
assert isinstance(e["message"], str) and e["message"], e
assert e["type"] in ("invalid_request_error", "not_found_error", "authentication_error", "rate_limit_error",
                     "server_error", "service_unavailable_error"), e
if sys.argv[2] != "-":
    assert e["param"] == sys.argv[2], e
PY
}
check_error 400 - -d '{"prompt": "x",' "$URL/v1/completions"
check_error 400 - -d '"just a string"' "$URL/v1/completions"
check_error 400 prompt -d '{"prompt": 5}' "$URL/v1/completions"
check_error 400 max_tokens -d '{"prompt": "x", "max_tokens": "ten"}' "$URL/v1/completions"
check_error 400 max_tokens -d '{"prompt": "x", "max_tokens": -1}' "$URL/v1/completions"
check_error 400 temperature -d '{"prompt": "x", "top_p": 1, "temperature": 9}' "$URL/v1/completions"
check_error 400 frequency -d '{"prompt": "x", "frequency": 1}' "$URL/v1/completions"
check_error 400 'prompt[1]' -d '{"prompt": [[1,2], 3]}' "$URL/v1/completions"
check_error 400 'prompt[3]' -d '{"prompt": [1,2,3,-4]}' "$URL/v1/completions"
check_error 400 stop -d '{"prompt": "x", "stop": {"a": 1}}' "$URL/v1/completions"
check_error 400 messages -d '{"messages": []}' "$URL/v1/chat/completions"
check_error 400 messages -d '{"messages": [{"role": "user", "content": "hi"}]}' "$URL/v1/chat/completions"  # no template
check_error 404 model -d '{"model": "gpt-4", "prompt": "x"}' "$URL/v1/completions"
head -c $((10 << 20)) /dev/zero | tr '\0' ' ' >"$WORK/big.json"
check_error 413 - --data-binary "@$WORK/big.json" "$URL/v1/completions"
check_error 404 - -X GET "$URL/v1/completion"
check_error 501 - -d '{"input": "x"}' "$URL/v1/embeddings"
# Every refusal above was counted, and no request was left behind.

# --- tokenize / detokenize / models / health ------------------------------------------
code=$(post -d '{"prompt":"Once upon a time","add_special_tokens":false}' "$URL/tokenize")
[ "$code" = 200 ] || fail "tokenize $code"
ids=$(python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); assert j["count"]==len(j["tokens"]); print(json.dumps(j["tokens"]))' "$WORK/body")
code=$(post -d "{\"tokens\":$ids}" "$URL/detokenize")
[ "$code" = 200 ] && python3 -c 'import json,sys; assert json.load(open(sys.argv[1]))["prompt"]=="Once upon a time"' "$WORK/body" ||
  fail "detokenize round trip: $(cat "$WORK/body")"
curl -sf "$URL/v1/models" | python3 -c 'import json,sys; j=json.load(sys.stdin); assert j["object"]=="list" and j["data"][0]["id"]=="stories", j' ||
  fail "models"
[ "$(curl -s -o /dev/null -w '%{http_code}' "$URL/health")" = 200 ] || fail "health"

# --- A client killed mid-stream aborts its request -------------------------------------
curl -sN -H 'Content-Type: application/json' \
  -d '{"prompt":"Once upon a time","max_tokens":480,"ignore_eos":true,"stream":true}' \
  "$URL/v1/completions" >"$WORK/killed.sse" 2>/dev/null &
CURL_PID=$!
for _ in $(seq 300); do grep -q '"text"' "$WORK/killed.sse" 2>/dev/null && break; sleep 0.1; done
grep -q '"text"' "$WORK/killed.sse" || fail "the long stream never started"
kill "$CURL_PID"
wait "$CURL_PID" 2>/dev/null
CURL_PID=""
running=1
for _ in $(seq 200); do
  curl -s "$URL/metrics" >"$WORK/metrics.txt"
  running=$(awk '/^exl3serve:num_requests_running/ {print $2}' "$WORK/metrics.txt")
  disconnects=$(awk '/^exl3serve:http_client_disconnects_total/ {s += $2} END {print s + 0}' "$WORK/metrics.txt")
  [ "${running%.*}" = 0 ] && [ "$disconnects" -ge 1 ] && break
  sleep 0.1
done
[ "${running%.*}" = 0 ] || fail "the killed stream kept running: $(grep -E 'running|disconnect' "$WORK/metrics.txt")"
grep -q 'exl3serve:request_success_total{finished_reason="abort"' "$WORK/metrics.txt" ||
  fail "abort not counted"

# --- /metrics is valid Prometheus text with the HTTP series ------------------------------
grep -q '^exl3serve:http_requests_total{endpoint="/v1/completions",model_name="stories",status="400"}' "$WORK/metrics.txt" ||
  fail "http_requests_total missing: $(grep http_ "$WORK/metrics.txt" | head)"
grep -q '^exl3serve:prompt_tokens_total' "$WORK/metrics.txt" || fail "coordinator series missing on /metrics"
# promtool parses it (rc 1 on a format error) and lints it (rc 3): the only
# lint finding allowed is vLLM's `prefix:` colon in the names.
if command -v promtool >/dev/null; then
  promtool check metrics <"$WORK/metrics.txt" >"$WORK/promtool.txt" 2>&1
  rc=$?
  [ $rc = 0 ] || [ $rc = 3 ] || fail "promtool check metrics (rc $rc): $(head "$WORK/promtool.txt")"
  if grep -v "^exl3serve:[a-zA-Z0-9_:]* metric names should not contain ':'$" "$WORK/promtool.txt" | grep -q .; then
    fail "promtool lint: $(cat "$WORK/promtool.txt")"
  fi
fi
serve_stop || fail "serve exited non-zero"
echo "PASS"
