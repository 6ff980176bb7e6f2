#!/usr/bin/env bash
# Multi-box cluster from one YAML with `exl3serve launch`: three network
# namespaces (the coordinator's box, box A with rank 0, box B with rank 1)
# joined by a Linux bridge in a 4th namespace (veth pairs, 10.2XX.Y.0/24 unique
# to this run; no traffic leaves these namespaces). Collectives: UCX over TCP,
# bootstrap on box A. Each box runs `ip netns exec NS exl3serve launch
# --config F --box X`; the API listens on 127.0.0.1 inside the coordinator's
# namespace and the client runs there. The rank endpoint listens on every
# address with TLS, mutual TLS and a rank token (a throwaway CA, openssl);
# the YAML's boxes carry devices, NICs and NCCL settings, which launch hands
# to each rank (flags and environment, checked in /proc).
#   1. a streamed request returns the ids of `exl3serve generate` on the model;
#   2. box B's link goes down while a request is in flight: within the
#      heartbeat timeout (+ slack) the coordinator reports not ready, rank 1
#      down (GetServerInfo), grpc.health.v1 NOT_SERVING, the HealthCheck
#      unhealthy and /metrics exl3serve:rank_up{rank="1"} 0;
#   3. the link comes back: the group re-forms (rank 1 reconnects), the
#      request in flight is replayed and returns the ids, a new request too,
#      and /metrics counted the restart and the replay.
# Processes and namespaces are removed on every exit path. Skips (77) without
# root or `ip netns`. $1: the exl3serve binary.
set -uo pipefail
BIN=$(readlink -f "$1")
if [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null 2>&1; then
  echo "skip: needs root and iproute2 for network namespaces"; exit 77
fi
command -v openssl >/dev/null || { echo "skip: no openssl"; exit 77; }
command -v curl >/dev/null || { echo "skip: no curl"; exit 77; }
TAG="e3mb$$"
NSC="${TAG}c" NSA="${TAG}a" NSB="${TAG}b" NSBR="${TAG}br"
NET="10.$(( 200 + $$ % 50 )).$(( ($$ / 50) % 250 + 1 ))"
ADDR_C="$NET.1" ADDR_A="$NET.2" ADDR_B="$NET.3"
WORK=$(mktemp -d)
PIDS=()
HEARTBEAT_MS=3000
cleanup() {
  set +e
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  for _ in $(seq 100); do
    alive=0
    for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 0.1
  done
  for ns in "$NSC" "$NSA" "$NSB" "$NSBR"; do
    pids=$(ip netns pids "$ns" 2>/dev/null)
    [ -n "$pids" ] && kill -9 $pids 2>/dev/null
  done
  wait 2>/dev/null
  for ns in "$NSC" "$NSA" "$NSB" "$NSBR"; do ip netns del "$ns" 2>/dev/null; done
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 1' INT TERM
fail() {
  echo "FAIL: $*"
  for f in "$WORK"/*.log; do [ -f "$f" ] && { echo "--- $f"; tail -30 "$f"; }; done
  exit 1
}

if ! ip netns add "$NSBR" 2>/dev/null; then echo "skip: cannot create network namespaces here"; exit 77; fi
set -e
ip -n "$NSBR" link add "${TAG}br" type bridge
ip -n "$NSBR" link set "${TAG}br" up
ip -n "$NSBR" link set lo up
i=1
for ns in "$NSC" "$NSA" "$NSB"; do
  ip netns add "$ns"
  ip link add "${TAG}v$i" type veth peer name "${TAG}p$i"   # v: in the box, p: on the bridge
  ip link set "${TAG}v$i" netns "$ns"
  ip link set "${TAG}p$i" netns "$NSBR"
  ip -n "$NSBR" link set "${TAG}p$i" master "${TAG}br"
  ip -n "$NSBR" link set "${TAG}p$i" up
  ip -n "$ns" addr add "$NET.$i/24" dev "${TAG}v$i"
  ip -n "$ns" link set lo up
  ip -n "$ns" link set "${TAG}v$i" up
  i=$((i + 1))
done
set +e
DEV_B="${TAG}v3"
# (no ping(8) here: the first request shows the boxes reach each other)

"$BIN" make-test-model --arch llama --peaked-logits --out "$WORK/model" >/dev/null || fail "make-test-model"
PROMPT=1,42,7,311,5
WANT=$("$BIN" --log-level warning generate --model "$WORK/model" --prompt-ids $PROMPT --max-tokens 16 \
       --ignore-eos --ids) || fail "generate"

# The rank channel's credentials: the coordinator's certificate names its box's address.
(
  cd "$WORK" || exit 1
  ossl() { openssl "$@" >/dev/null 2>&1 || { echo "openssl $* failed"; exit 1; }; }
  ossl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 -subj /CN=cluster-ca \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"
  for spec in "endpoint:subjectAltName=IP:$ADDR_C
extendedKeyUsage=serverAuth" "rank:extendedKeyUsage=clientAuth"; do
    name=${spec%%:*}
    ossl req -newkey rsa:2048 -nodes -keyout "$name.key" -out "$name.csr" -subj "/CN=$name"
    printf '%s\n' "${spec#*:}" >"$name.ext"
    ossl x509 -req -in "$name.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -out "$name.pem" -days 2 \
      -extfile "$name.ext"
  done
  echo "rank-token-$RANDOM$RANDOM" >rank-token
) || fail "certificates"

DEV_A="${TAG}v2"
cat >"$WORK/cluster.yaml" <<YAML
model_dir: $WORK/model
world_size: 2
listen_address: 0.0.0.0:50061
api_address: 127.0.0.1:50051
shutdown_grace_ms: 2000
comm:
  backend: ucx
  bootstrap_address: "$ADDR_A:50071"
  ucx: {tls: tcp}
  nccl: {net: Socket, ib_gid_index: 3}
tls:
  rank_cert: $WORK/endpoint.pem
  rank_key: $WORK/endpoint.key
  rank_ca: $WORK/ca.pem
  rank_client_cert: $WORK/rank.pem
  rank_client_key: $WORK/rank.key
rank_token_file: $WORK/rank-token
kv: {num_pages: 256, page_size_tokens: 16}
timeouts: {join_ms: 60000, heartbeat_interval_ms: 500, heartbeat_ms: $HEARTBEAT_MS, reform_ms: 60000, step_ms: 20000, collective_ms: 20000}
boxes:
  - {name: lead, address: $ADDR_C, coordinator: true, metrics_port: 9400}
  - {name: a, address: $ADDR_A, devices: [0, 1], nics: [$DEV_A], ranks: [0], rank_devices: [1]}
  - name: b
    address: $ADDR_B
    devices: [0]
    nics: [$DEV_B]
    nccl: {ib_hca: "mlx5_0:1"}
    ranks: [1]
    rank_devices: [0]
YAML
export UCX_TLS=tcp
# Strangers on the rank bootstrap, from a third box of the same network: a
# slow loris that connects and never speaks, garbage, a hello without the
# token proof and one with a guessed token. Box b cannot reach box a until they are connected (an
# unreachable route; rank 1 retries), so they are there before the real rank
# whatever the timing; then the route goes and the group must still form.
ip -n "$NSB" route add unreachable "$ADDR_A/32" || fail "cannot hold box b back"
ip netns exec "$NSC" python3 - "$ADDR_A" 50071 >"$WORK/stranger.log" 2>&1 <<'PY' &
import hashlib, hmac, socket, struct, sys, time
host, port = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + 120
def connect():
    while time.monotonic() < deadline:
        try:
            return socket.create_connection((host, port), timeout=1)
        except OSError:
            time.sleep(0.02)  # a back-off: the port opens when rank 0 gets its Setup
    sys.exit("the bootstrap port never opened")
loris = connect()
garbage = connect()
garbage.sendall(b"GET / HTTP/1.1\r\n\r\n")
plain = connect()
plain.sendall(struct.pack("<IIQ", 0x31425845, 1, 16) + struct.pack("<IIQ", 1, 2, 0))
# A guessed token: answer rank 0's challenge (frame header + 32-byte nonce)
# with a hello whose MAC uses the wrong key.
guess = connect()
challenge = b""
while len(challenge) < 48:
    challenge += guess.recv(48 - len(challenge))
hello = struct.pack("<IIQ", 1, 2, 0)
nonce = bytes(32)
mac = hmac.new(b"a-guessed-token", b"exl3serve bootstrap hello v1" + challenge[16:] + hello + nonce,
               hashlib.sha256).digest()
guess.sendall(struct.pack("<IIQ", 0x31425845, 1, 80) + hello + nonce + mac)
print("strangers connected", flush=True)
for name, s in (("loris", loris), ("garbage", garbage), ("plain hello", plain), ("guessed token", guess)):
    s.settimeout(60)
    try:
        while s.recv(4096):
            pass
        print(name, "closed by rank 0", flush=True)
    except ConnectionResetError:  # closed with our bytes unread: a reset
        print(name, "closed by rank 0 (reset)", flush=True)
    except OSError as e:
        print(name, "error", e, flush=True)
PY
STRANGER=$!
PIDS+=($STRANGER)
for spec in "$NSC:lead" "$NSA:a" "$NSB:b"; do
  ns=${spec%%:*} box=${spec##*:}
  ip netns exec "$ns" "$BIN" --log-level warning launch --config "$WORK/cluster.yaml" --box "$box" \
      --threads 1 >"$WORK/$box.log" 2>&1 &
  PIDS+=($!)
done
C() { ip netns exec "$NSC" "$BIN" client --addr 127.0.0.1:50051 "$@"; }
timeout 120 grep -q -m1 "strangers connected" <(tail -F "$WORK/stranger.log" 2>/dev/null) ||
  fail "the strangers never reached the bootstrap port: $(cat "$WORK/stranger.log")"
ip -n "$NSB" route del unreachable "$ADDR_A/32" || fail "cannot release box b"
C --health --wait-ready-ms 120000 >/dev/null || fail "not ready in 120 s"
wait "$STRANGER"
[ "$(grep -c "closed by rank 0" "$WORK/stranger.log")" = 4 ] ||
  fail "rank 0 left a stranger connected: $(cat "$WORK/stranger.log")"
refusals=$(grep "tcp bootstrap" "$WORK"/a.log | grep -c "$ADDR_C:")
[ "$refusals" -ge 4 ] || fail "rank 0 logged $refusals refusals naming $ADDR_C: $(grep -i bootstrap "$WORK"/a.log)"
grep -q "refused $ADDR_C:[0-9]*: wrong rank token" "$WORK"/a.log || fail "no 'wrong rank token' refusal logged"
echo "four strangers on the bootstrap port were refused ($refusals log lines name $ADDR_C); the group formed"
# The UCX bootstrap across the boxes is authenticated with the rank token
# (and its frames sealed: tests/comm/tcp_bootstrap_test.cc).
grep -q "tcp bootstrap: rank 1 joined from $ADDR_B:[0-9]* (rank token verified)" "$WORK"/a.log ||
  fail "rank 0 did not verify rank 1's token on the bootstrap: $(grep -i bootstrap "$WORK"/a.log | tail -5)"
echo "the rank bootstrap verified rank 1's rank token"

# What launch handed each rank: the channel's credentials, the box's NICs and
# NCCL settings as flags, the rank's GPU and the NICs as environment.
rank_proc_check() {  # box rank device nic extra-flag-pattern
  local pid
  pid=$(sed -n "s/^launch: rank $2 started (pid \([0-9]*\)).*/\1/p" "$WORK/$1.log" | tail -1)
  [ -n "$pid" ] || fail "no 'launch: rank $2 started' line in $1.log"
  local cmd env
  cmd=$(tr '\0' ' ' <"/proc/$pid/cmdline") env=$(tr '\0' '\n' <"/proc/$pid/environ")
  for want in "--tls-ca $WORK/ca.pem" "--tls-server-name $ADDR_C" "--tls-cert $WORK/rank.pem" \
      "--tls-key $WORK/rank.key" "--rank-token-file $WORK/rank-token" "--nccl-net Socket" \
      "--nccl-ib-gid-index 3" "--nccl-socket-ifname $4" "$5"; do
    [[ "$cmd" == *"$want"* ]] || fail "rank $2's command line lacks '$want': $cmd"
  done
  grep -qx "CUDA_VISIBLE_DEVICES=$3" <<<"$env" || fail "rank $2: CUDA_VISIBLE_DEVICES is not $3"
  grep -qx "UCX_NET_DEVICES=$4" <<<"$env" || fail "rank $2: UCX_NET_DEVICES is not $4"
}
rank_proc_check a 0 1 "$DEV_A" "--rank 0"
rank_proc_check b 1 0 "$DEV_B" "--nccl-ib-hca mlx5_0:1"
echo "launch passed each rank its credentials, NICs, NCCL settings and GPU"

METRICS_URL="http://$ADDR_C:9400/metrics"
metric() {  # name [label-pattern]: the value of the first matching series ("" when none)
  ip netns exec "$NSC" curl -s --max-time 5 "$METRICS_URL" |
    awk -v n="$1" -v l="${2:-}" 'index($1, n) == 1 && (l == "" || index($1, l)) && substr($1, length(n) + 1, 1) ~ /[{ ]|^$/ {print $2; exit}'
}
[ "$(metric 'exl3serve:rank_up' 'rank="1"')" = 1 ] || fail "rank_up{rank=1} is not 1 while ready"
RESTARTS0=$(metric exl3serve:rank_restarts_total)
REPLAYS0=$(metric exl3serve:request_replays_total)
[ -n "$RESTARTS0" ] && [ -n "$REPLAYS0" ] || fail "no rank_restarts_total / request_replays_total at $METRICS_URL"

GOT=$(C --prompt-ids $PROMPT --max-tokens 16 --ignore-eos --ids --timeout-ms 60000) || fail "client request"
[ "$GOT" = "$WANT" ] || fail "ids differ: client '$GOT' vs generate '$WANT'"
echo "stream across boxes: $GOT (== generate)"

info_check() {  # READY DOWN_RANK: GetServerInfo says ready=READY and rank DOWN_RANK up=false ("" = all up)
  C --info --timeout-ms 5000 2>/dev/null | /usr/bin/python3 -c '
import json, sys
info = json.load(sys.stdin).get("server", {})
want_ready = sys.argv[1] == "1"
ranks = {int(r.get("rank", 0)): bool(r.get("up", False)) for r in info.get("ranks", [])}
ok = bool(info.get("ready", False)) == want_ready
if sys.argv[2]: ok = ok and ranks.get(int(sys.argv[2])) is False
else: ok = ok and len(ranks) == 2 and all(ranks.values())
sys.exit(0 if ok else 1)' "$1" "$2"
}
info_check 1 "" || { C --info; fail "GetServerInfo: not ready with every rank up"; }

# --- link down on box B while a request is in flight: detected within the
# heartbeat timeout (+ slack); the request waits for the group and is replayed
ip -n "$NSB" link set "$DEV_B" down
T0=$(date +%s%N)
C --prompt-ids $PROMPT --max-tokens 16 --ignore-eos --ids --timeout-ms 120000 \
  >"$WORK/inflight.out" 2>"$WORK/inflight.err" &
INFLIGHT=$!
detected=""
for _ in $(seq 300); do
  if info_check 0 1; then detected=1; break; fi
  sleep 0.1
done
DT_MS=$(( ($(date +%s%N) - T0) / 1000000 ))
[ -n "$detected" ] || { C --info; fail "rank 1 not reported down 30 s after box B's link went down"; }
(( DT_MS <= HEARTBEAT_MS + 3000 )) || fail "loss detected after $DT_MS ms (heartbeat timeout $HEARTBEAT_MS ms)"
if C --health >/dev/null 2>&1; then fail "HealthCheck healthy with box B unreachable"; fi
# grpc.health.v1 (Watch): NOT_SERVING now, not SERVING from before the loss.
if C --health --wait-ready-ms 500 >/dev/null 2>"$WORK/watch.err"; then
  fail "grpc.health.v1 SERVING with box B unreachable"
fi
grep -q "last health: NOT_SERVING" "$WORK/watch.err" || { cat "$WORK/watch.err"; fail "grpc.health.v1 not NOT_SERVING"; }
UP1=$(metric 'exl3serve:rank_up' 'rank="1"')
[ "$UP1" = 0 ] || fail "/metrics rank_up{rank=\"1\"} is '$UP1' with box B unreachable, want 0"
echo "box B down: not ready, rank 1 down after $DT_MS ms (heartbeat_ms $HEARTBEAT_MS); grpc.health.v1 NOT_SERVING; rank_up{rank=1} 0"

# --- link up: the group re-forms, a new request succeeds
ip -n "$NSB" link set "$DEV_B" up
# (polled: grpc.health.v1's Watch may still say SERVING from before the loss)
T0=$(date +%s)
until C --health >/dev/null 2>&1; do
  (( $(date +%s) - T0 < 180 )) || { C --info; fail "not ready again 180 s after the link came back"; }
  sleep 0.5
done
info_check 1 "" || { C --info; fail "GetServerInfo after re-forming"; }
GOT=$(C --prompt-ids $PROMPT --max-tokens 16 --ignore-eos --ids --timeout-ms 60000) || fail "request after re-forming"
[ "$GOT" = "$WANT" ] || fail "ids after re-forming differ: '$GOT' vs '$WANT'"
# The readiness line is written by the coordinator's change callback, which can
# trail the health answer under load: poll for it (bounded) instead of one look.
for _ in $(seq 100); do
  grep -q "^coordinator: ready (group generation [2-9]" "$WORK/lead.log" && break
  sleep 0.1
done
grep -q "^coordinator: ready (group generation [2-9]" "$WORK/lead.log" || fail "no re-formed group generation in the coordinator's log"
wait "$INFLIGHT" || { cat "$WORK/inflight.err"; fail "the request in flight during the outage failed"; }
[ "$(cat "$WORK/inflight.out")" = "$WANT" ] || fail "the replayed request returned '$(cat "$WORK/inflight.out")', want '$WANT'"
RESTARTS1=$(metric exl3serve:rank_restarts_total) REPLAYS1=$(metric exl3serve:request_replays_total)
/usr/bin/python3 -c 'import sys; a = list(map(float, sys.argv[1:])); sys.exit(0 if a[1] > a[0] and a[3] > a[2] else 1)' \
  "$RESTARTS0" "$RESTARTS1" "$REPLAYS0" "$REPLAYS1" ||
  fail "/metrics after recovery: rank_restarts_total $RESTARTS0 -> $RESTARTS1, request_replays_total $REPLAYS0 -> $REPLAYS1 (both must grow)"
[ "$(metric 'exl3serve:rank_up' 'rank="1"')" = 1 ] || fail "rank_up{rank=1} is not 1 after recovery"
echo "box B back: re-formed, $GOT; the request in flight was replayed; restarts $RESTARTS0 -> $RESTARTS1, replays $REPLAYS0 -> $REPLAYS1"

# --- a rank that exits unexpectedly is restarted by its box's launch
P0=$(sed -n 's/^launch: rank 0 started (pid \([0-9]*\)).*/\1/p' "$WORK/a.log" | tail -1)
[ -n "$P0" ] || fail "no 'launch: rank 0 started' line"
kill -9 "$P0"
for _ in $(seq 100); do grep -q "^launch: rank 0 (pid $P0) exited" "$WORK/a.log" && break; sleep 0.1; done
grep -q "^launch: rank 0 (pid $P0) exited" "$WORK/a.log" || fail "launch did not notice rank 0's death"
T0=$(date +%s)
until C --health >/dev/null 2>&1 && [ "$(grep -c '^launch: rank 0 started' "$WORK/a.log")" -ge 2 ]; do
  (( $(date +%s) - T0 < 180 )) || { C --info; fail "not ready 180 s after rank 0 was killed"; }
  sleep 0.5
done
GOT=$(C --prompt-ids $PROMPT --max-tokens 16 --ignore-eos --ids --timeout-ms 60000) || fail "request after the restart"
[ "$GOT" = "$WANT" ] || fail "ids after the restart differ: '$GOT' vs '$WANT'"
echo "rank 0 killed: restarted by launch, ready again, $GOT"

# --- SIGTERM stops every box cleanly
for pid in "${PIDS[@]}"; do kill -TERM "$pid"; done
for pid in "${PIDS[@]}"; do
  for _ in $(seq 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$pid" 2>/dev/null && fail "launch pid $pid did not stop 30 s after SIGTERM"
  wait "$pid"; rc=$?
  [ $rc = 0 ] || fail "launch pid $pid exited $rc after SIGTERM"
done
PIDS=()
for ns in "$NSC" "$NSA" "$NSB"; do
  [ -z "$(ip netns pids "$ns")" ] || fail "processes left in $ns after SIGTERM: $(ip netns pids "$ns")"
done
grep -q "^stopped" "$WORK/lead.log" || fail "the coordinator printed no 'stopped'"
echo "multibox: OK"
