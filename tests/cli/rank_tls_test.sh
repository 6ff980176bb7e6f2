#!/usr/bin/env bash
# The coordinator<->rank channel's security end to end (coordinator/rank_group.h
# RankEndpointSecurity, worker/rank/rank_client.h): a throwaway CA signs the
# coordinator's rank-endpoint certificate and a rank client certificate, a
# second CA a rogue one (openssl, in a temp dir). `exl3serve coordinator` runs
# with TLS on the rank endpoint, mutual TLS (tls.rank_client_cert) and a rank
# token (rank_token_file). Refused, each with a clear error from `exl3serve
# worker` and the coordinator staying unready: a rank certificate of another
# CA, no rank certificate, no token, a wrong token, a plaintext rank, and a
# rank that does not trust the coordinator's CA. Then two ranks with the right
# certificate and token form the group and a request streams. A non-loopback
# listen_address without rank credentials is refused at start (naming the
# key), and accepted with insecure_rank_listen_any. A trap stops every process.
set -uo pipefail
BIN=$1
command -v openssl >/dev/null || { echo "skip: no openssl"; exit 77; }
WORK=$(mktemp -d)
PIDS=()
stop_all() {
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  for pid in "${PIDS[@]}"; do
    for _ in $(seq 200); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
    wait "$pid" 2>/dev/null
  done
  PIDS=()
}
cleanup() { stop_all >/dev/null 2>&1; rm -rf "$WORK"; }
trap cleanup EXIT
trap 'exit 1' INT TERM
fail() {
  echo "FAIL: $*"
  for f in "$WORK"/*.log; do [ -f "$f" ] && { echo "--- $f"; tail -20 "$f"; }; done
  exit 1
}

source "$(dirname "${BASH_SOURCE[0]}")/lib/test_certs.sh"
cd "$WORK" || exit 1
mkca ca
mkca otherca
mkcert endpoint ca "subjectAltName=IP:127.0.0.1,DNS:localhost
extendedKeyUsage=serverAuth"
mkcert rank ca "extendedKeyUsage=clientAuth"
mkcert rogue otherca "extendedKeyUsage=clientAuth"
echo "rank-token-$RANDOM$RANDOM" >token
echo "rank_tls: certificates made"

"$BIN" make-test-model --arch llama --peaked-logits --out "$WORK/model" >/dev/null || fail "make-test-model"

# --- the loopback rule for the rank endpoint, at start (before any rank)
base() {  # listen_address
  cat <<YAML
model_dir: $WORK/model
world_size: 2
listen_address: $1
api_address: 127.0.0.1:0
shutdown_grace_ms: 1000
comm: {backend: shm}
kv: {num_pages: 64, page_size_tokens: 16}
timeouts: {heartbeat_interval_ms: 300, heartbeat_ms: 3000}
YAML
}
base 0.0.0.0:0 >open.yaml
if timeout 20 "$BIN" --log-level warning coordinator --config open.yaml >open.log 2>&1; then
  fail "a coordinator listening for ranks on 0.0.0.0 without credentials started"
fi
grep -q "config key \`listen_address\`: refusing to listen for ranks on 0.0.0.0 without credentials" open.log ||
  fail "no clear error for listen_address 0.0.0.0 without credentials"
{ base 0.0.0.0:0; echo "insecure_rank_listen_any: true"; } >risk.yaml
"$BIN" --log-level warning coordinator --config risk.yaml >risk.log 2>&1 &
PIDS+=($!)
for _ in $(seq 100); do grep -q '^listening on' risk.log && break; sleep 0.1; done
grep -q '^listening on' risk.log || fail "insecure_rank_listen_any: true was not accepted"
stop_all
echo "rank_tls: listen_address 0.0.0.0 without rank credentials is refused at start (and allowed when asked)"

# --- the secured coordinator: TLS + mutual TLS + a rank token on the rank endpoint
{ base 127.0.0.1:0; cat <<YAML
tls:
  rank_cert: $WORK/endpoint.pem
  rank_key: $WORK/endpoint.key
  rank_ca: $WORK/ca.pem
  rank_client_cert: $WORK/rank.pem
  rank_client_key: $WORK/rank.key
rank_token_file: $WORK/token
YAML
} >cluster.yaml
"$BIN" --log-level warning coordinator --config cluster.yaml --port-file rank.port >coord.log 2>&1 &
PIDS+=($!)
for _ in $(seq 200); do [ -s rank.port ] && grep -q '^listening on' coord.log && break; sleep 0.1; done
[ -s rank.port ] || fail "no rank port"
RANK_ADDR=127.0.0.1:$(cat rank.port)
API=$(sed -n 's/^listening on //p' coord.log)
[ -n "$API" ] || fail "no 'listening on' line"

not_ready() {  # the coordinator is up, unready, no rank registered
  "$BIN" client --addr "$API" --health >/dev/null 2>&1 && fail "$1: health SERVING"
  "$BIN" client --addr "$API" --info --timeout-ms 5000 2>/dev/null | /usr/bin/python3 -c '
import json, sys
s = json.load(sys.stdin).get("server", {})
sys.exit(0 if not s.get("ready", False) and not any(r.get("up") for r in s.get("ranks", [])) else 1)' ||
    fail "$1: GetServerInfo shows a rank up or the group ready"
}
GOOD=(--tls-ca ca.pem --tls-cert rank.pem --tls-key rank.key --rank-token-file token)
refused() {  # what pattern args...: `worker` (rank 1) must exit non-zero, stderr matching pattern
  local what=$1 pattern=$2; shift 2
  timeout 60 "$BIN" --log-level warning worker --coordinator "$RANK_ADDR" --rank 1 --world-size 2 \
      --connect-timeout-ms 3000 "$@" >refused.log 2>&1
  local rc=$?
  [ $rc != 0 ] || { cat refused.log; fail "$what: the rank was accepted (exit 0)"; }
  [ $rc != 124 ] || { cat refused.log; fail "$what: the rank hung"; }
  grep -Eq "$pattern" refused.log || { cat refused.log; fail "$what: error not /$pattern/"; }
  not_ready "$what"
  echo "rank_tls: $what -> refused: $(grep -o "error: .*" refused.log | cut -c1-160 | head -1)"
}
# (a refused client certificate: the TLS handshake fails on the coordinator's
# side, which logs it; the rank sees its connection closed and says why that
# usually happens)
REFUSED_CERT="(Socket closed|closed the stream before answering).*coordinator refused this rank's client certificate"
refused "a rank certificate of another CA" "$REFUSED_CERT" \
  --tls-ca ca.pem --tls-cert rogue.pem --tls-key rogue.key --rank-token-file token
grep -q "Handshake failed.*certificate verify failed" coord.log || fail "the coordinator did not log the rogue certificate"
refused "no rank certificate" "$REFUSED_CERT" --tls-ca ca.pem --rank-token-file token
grep -q "Handshake failed.*peer did not return a certificate" coord.log || fail "the coordinator did not log the missing certificate"
refused "no rank token" "UNAUTHENTICATED: missing rank token|missing rank token" \
  --tls-ca ca.pem --tls-cert rank.pem --tls-key rank.key
echo "wrong-$RANDOM" >wrong-token
refused "a wrong rank token" "wrong rank token" \
  --tls-ca ca.pem --tls-cert rank.pem --tls-key rank.key --rank-token-file wrong-token
refused "a plaintext rank" "not reachable within .*plaintext: does the coordinator's rank endpoint use TLS" \
  --rank-token-file token
refused "a rank that does not trust the coordinator's CA" "not reachable within .*certificate verify failed" \
  --tls-ca otherca.pem --tls-cert rank.pem --tls-key rank.key --rank-token-file token
grep -q "rank connection from .* refused: missing rank token" coord.log ||
  fail "the coordinator did not log the refused token"

# --- the right certificate and token: the group forms and serves
for r in 0 1; do
  "$BIN" --log-level warning worker --coordinator "$RANK_ADDR" --rank $r --world-size 2 --reconnect \
      --threads 1 "${GOOD[@]}" >"rank$r.log" 2>&1 &
  PIDS+=($!)
done
"$BIN" client --addr "$API" --health --wait-ready-ms 120000 >/dev/null || fail "not ready over mutual TLS in 120 s"
OUT=$("$BIN" client --addr "$API" --prompt-ids 1,42,7,311 --max-tokens 8 --ignore-eos --ids \
      --timeout-ms 30000 2>ok.err) || { cat ok.err; fail "a request over the secured group"; }
[ "$(echo "$OUT" | wc -w)" = 8 ] || fail "streamed [$OUT], want 8 ids"
WANT=$("$BIN" --log-level warning generate --model "$WORK/model" --prompt-ids 1,42,7,311 --max-tokens 8 \
       --ignore-eos --ids) || fail "generate"
[ "$OUT" = "$WANT" ] || fail "ids differ: '$OUT' vs generate '$WANT'"
echo "rank_tls: the right certificate and token: ready, 8 tokens streamed (== generate): $OUT"
stop_all
echo "PASS"
