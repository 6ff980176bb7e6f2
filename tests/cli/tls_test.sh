#!/usr/bin/env bash
# The public API's security (coordinator/grpc_server.h) end to end: a
# throwaway CA signs a server and a client certificate (openssl, in a temp
# dir); `exl3serve serve` runs with TLS, a client CA (mutual TLS) and a bearer
# token; `exl3serve client` with the right certificate and token streams; no
# client certificate, a certificate from another CA, a missing or wrong token
# and a plaintext client are refused; a non-loopback --host without
# credentials is refused at start. A trap stops the server on every exit.
set -uo pipefail
BIN=$1
command -v openssl >/dev/null || { echo "skip: no openssl"; exit 77; }
WORK=$(mktemp -d)
SERVER_PID=""
stop_server() {
  [ -n "$SERVER_PID" ] || return 0
  kill -TERM "$SERVER_PID" 2>/dev/null
  for _ in $(seq 200); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$SERVER_PID" 2>/dev/null && kill -KILL "$SERVER_PID"
  wait "$SERVER_PID"; local rc=$?
  SERVER_PID=""
  return $rc
}
cleanup() { stop_server >/dev/null 2>&1; rm -rf "$WORK"; }
trap cleanup EXIT
trap 'exit 1' INT TERM
fail() { echo "FAIL: $*"; [ -f "$WORK/server.log" ] && { echo "--- server.log"; tail -30 "$WORK/server.log"; }; exit 1; }

# Certificates: CA -> server (SAN 127.0.0.1, localhost) and client; a second CA -> rogue client.
source "$(dirname "${BASH_SOURCE[0]}")/lib/test_certs.sh"
cd "$WORK" || exit 1
mkca ca
mkca otherca
mkcert server ca "subjectAltName=IP:127.0.0.1,DNS:localhost
extendedKeyUsage=serverAuth"
mkcert client ca "extendedKeyUsage=clientAuth"
mkcert rogue otherca "extendedKeyUsage=clientAuth"
echo "s3cret-token-$RANDOM$RANDOM" >token
echo "tls: certificates made"

"$BIN" make-test-model --arch llama --peaked-logits --out "$WORK/model" >/dev/null || fail "make-test-model"

# Without credentials a non-loopback host is refused at start, before loading.
if "$BIN" --log-level warning serve --model "$WORK/model" --host 0.0.0.0 --port 0 >"$WORK/open.log" 2>&1; then
  fail "serve --host 0.0.0.0 without credentials started"
fi
grep -q "refusing to listen on 0.0.0.0 without credentials" "$WORK/open.log" || { cat "$WORK/open.log"; fail "no clear error for 0.0.0.0"; }
# TLS without a client check is not enough either.
if "$BIN" --log-level warning serve --model "$WORK/model" --host 0.0.0.0 --port 0 \
    --tls-cert server.pem --tls-key server.key >"$WORK/open2.log" 2>&1; then
  fail "serve --host 0.0.0.0 with TLS but no token/client CA started"
fi
grep -q "refusing to listen" "$WORK/open2.log" || { cat "$WORK/open2.log"; fail "TLS-only error"; }
echo "tls: a non-loopback host without credentials is refused at start"

"$BIN" --log-level warning serve --model "$WORK/model" --host 127.0.0.1 --port 0 \
    --tls-cert server.pem --tls-key server.key --tls-client-ca ca.pem --auth-token-file token \
    --http-port 0 --shutdown-grace-ms 2000 >"$WORK/server.log" 2>&1 &
SERVER_PID=$!
ADDR=""
for _ in $(seq 600); do
  ADDR=$(sed -n 's/^listening on //p' "$WORK/server.log")
  [ -n "$ADDR" ] && break
  kill -0 "$SERVER_PID" 2>/dev/null || fail "serve exited before listening"
  sleep 0.1
done
[ -n "$ADDR" ] || fail "no 'listening on' line"
GOOD=(--tls-ca ca.pem --tls-cert client.pem --tls-key client.key)
"$BIN" client --addr "$ADDR" "${GOOD[@]}" --health --wait-ready-ms 120000 --token-file token >/dev/null ||
  fail "not ready over mutual TLS in 120 s"

# The right certificate and token: a request streams.
OUT=$("$BIN" client --addr "$ADDR" "${GOOD[@]}" --token "$(cat token)" --prompt-ids 1,42,7,311 \
      --max-tokens 8 --ignore-eos --ids --timeout-ms 30000 2>"$WORK/ok.err") || { cat "$WORK/ok.err"; fail "the right cert + token"; }
[ "$(echo "$OUT" | wc -w)" = 8 ] || fail "streamed [$OUT], want 8 ids"
grep -q "finish length" "$WORK/ok.err" || { cat "$WORK/ok.err"; fail "no finish line"; }
echo "tls: the right client certificate and token stream 8 tokens: $OUT"

refused() {  # what expected-pattern args...: the client must exit non-zero with the pattern
  local what=$1 pattern=$2; shift 2
  if "$BIN" client --addr "$ADDR" --prompt-ids 1,2,3 --max-tokens 4 --timeout-ms 10000 "$@" \
      >/dev/null 2>"$WORK/refused.err"; then
    fail "$what: accepted"
  fi
  grep -Eq "$pattern" "$WORK/refused.err" || { cat "$WORK/refused.err"; fail "$what: not /$pattern/"; }
  echo "tls: $what -> refused ($(grep -Eo "$pattern" "$WORK/refused.err" | head -1))"
}
refused "no client certificate" "UNAVAILABLE" --tls-ca ca.pem --token-file token
refused "a certificate from another CA" "UNAVAILABLE" --tls-ca ca.pem --tls-cert rogue.pem --tls-key rogue.key --token-file token
refused "a missing token" "UNAUTHENTICATED: missing bearer token" "${GOOD[@]}"
refused "a wrong token" "UNAUTHENTICATED: wrong bearer token" "${GOOD[@]}" --token "not-$(cat token)"
refused "a plaintext client" "UNAVAILABLE" --token-file token
# Every public RPC checks the token, not only Generate.
if "$BIN" client --addr "$ADDR" "${GOOD[@]}" --info --timeout-ms 10000 >/dev/null 2>"$WORK/info.err"; then
  fail "--info without a token accepted"
fi
grep -q UNAUTHENTICATED "$WORK/info.err" || { cat "$WORK/info.err"; fail "--info without a token"; }
"$BIN" client --addr "$ADDR" "${GOOD[@]}" --token-file token --info >/dev/null || fail "--info with the token"
echo "tls: GetModelInfo/GetServerInfo need the token too"

# The OpenAI HTTP API has the same TLS, client CA and token.
HTTP=$(sed -n 's/^http: listening on //p' "$WORK/server.log")
[ -n "$HTTP" ] || fail "no 'http: listening on' line"
BODY='{"prompt":[1,42,7,311],"max_tokens":8,"ignore_eos":true,"return_token_ids":true}'
CURL_GOOD=(--cacert ca.pem --cert client.pem --key client.key)
code=$(curl -s -o "$WORK/https.json" -w '%{http_code}' "${CURL_GOOD[@]}" -H "Authorization: Bearer $(cat token)" \
  -d "$BODY" "https://$HTTP/v1/completions")
[ "$code" = 200 ] || fail "HTTPS with the client certificate and token: $code $(cat "$WORK/https.json")"
python3 -c 'import json,sys; assert len(json.load(open(sys.argv[1]))["choices"][0]["token_ids"]) == 8' "$WORK/https.json" ||
  fail "HTTPS completion: $(cat "$WORK/https.json")"
code=$(curl -s -o "$WORK/https.json" -w '%{http_code}' "${CURL_GOOD[@]}" -d "$BODY" "https://$HTTP/v1/completions")
[ "$code" = 401 ] || fail "HTTPS without the token: $code"
curl -s -o /dev/null --cacert ca.pem -d "$BODY" "https://$HTTP/v1/completions" &&
  fail "HTTPS without a client certificate was accepted"
curl -s -o /dev/null -d "$BODY" "http://$HTTP/v1/completions" && [ "$(curl -s -o /dev/null -w '%{http_code}' -d "$BODY" "http://$HTTP/v1/completions")" != 000 ] &&
  fail "plaintext HTTP was answered"
echo "tls: the HTTP API needs the client certificate and the token too"

stop_server || fail "serve exited non-zero"
echo "PASS"
