#!/usr/bin/env bash
# Two ucx ranks on two "hosts": network namespaces joined by a veth pair
# (10.200.X.1/24 and 10.200.X.2/24, names unique to this run), UCX's tcp
# transport only (no shared memory can join namespaces anyway), the rank
# processes are tests/tools/comm_rank_tool.
#   1. Both ranks run every collective; both must succeed with the same
#      hash, equal to the tool's single-process reference hash, and the
#      traffic must have crossed the veth pair.
#   2. One rank SIGKILLs itself mid-run (first rank 1, then rank 0, the
#      bootstrap root); the survivor must exit nonzero well before its
#      per-call deadline.
# Needs root and `ip netns`; exits 77 (skip) without them. Touches only the
# namespaces and veth pair it creates, and removes them on exit, also on
# failure. $1 is the exl3serve binary (unused); EXL3_BUILD_DIR locates the tool.
set -uo pipefail

if [[ $(id -u) != 0 ]]; then echo "skip: needs root for ip netns"; exit 77; fi
if ! command -v ip >/dev/null 2>&1; then echo "skip: no ip(8)"; exit 77; fi
TOOL=${EXL3_BUILD_DIR:-build}/tests/comm_rank_tool
if [[ ! -x $TOOL ]]; then echo "FAIL: $TOOL is not built (ninja comm_rank_tool)"; exit 1; fi

ID=$$
NSA=exl3ucx${ID}a
NSB=exl3ucx${ID}b
VA=u3a${ID}          # interface names: at most 15 characters
VB=u3b${ID}
NET=10.200.$((ID % 250 + 1))
PORT=29517           # free: the namespaces are new
CALL_TIMEOUT_MS=20000
TMP=$(mktemp -d)

cleanup() {
  for ns in "$NSA" "$NSB"; do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null; done
  done
  wait 2>/dev/null
  ip netns del "$NSA" 2>/dev/null
  ip netns del "$NSB" 2>/dev/null
  ip link del "$VA" 2>/dev/null
  rm -rf "$TMP"
}
trap cleanup EXIT

if ! ip netns add "$NSA" 2>"$TMP/err"; then
  echo "skip: ip netns unavailable: $(cat "$TMP/err")"; exit 77
fi
set -e
ip netns add "$NSB"
ip link add "$VA" type veth peer name "$VB"
ip link set "$VA" netns "$NSA"
ip link set "$VB" netns "$NSB"
ip -n "$NSA" addr add "$NET.1/24" dev "$VA"
ip -n "$NSB" addr add "$NET.2/24" dev "$VB"
for ns in "$NSA" "$NSB"; do ip -n "$ns" link set lo up; done
ip -n "$NSA" link set "$VA" up
ip -n "$NSB" link set "$VB" up
set +e

fail() { echo "FAIL: $*"; for f in "$TMP"/*.out "$TMP"/*.err; do [[ -s $f ]] && { echo "--- $f"; cat "$f"; }; done; exit 1; }

# run_rank NS RANK DEVICE NAME [tool flags...]: starts one rank in the
# background, bounded by a hard timeout; its pid goes to $LAST_PID.
run_rank() {
  local ns=$1 rank=$2 dev=$3 name=$4
  shift 4
  ip netns exec "$ns" timeout -s KILL 120 "$TOOL" --backend ucx --rank "$rank" --world 2 \
    --bootstrap "$NET.1:$PORT" --tls tcp --net-devices "$dev" "$@" >"$TMP/$name.out" 2>"$TMP/$name.err" &
  LAST_PID=$!
}
tx_bytes() { ip netns exec "$1" cat "/sys/class/net/$2/statistics/tx_bytes"; }
now_ms() { echo $(($(date +%s%N) / 1000000)); }

# --- 1. every collective, across the namespaces -------------------------------------
SIZE=100003
SEED=$((ID % 1000 + 1))
FLAGS=(--check all --size "$SIZE" --seed "$SEED" --iters 3 --timeout-ms "$CALL_TIMEOUT_MS")
tx_a0=$(tx_bytes "$NSA" "$VA"); tx_b0=$(tx_bytes "$NSB" "$VB")
run_rank "$NSA" 0 "$VA" ok0 "${FLAGS[@]}"; P0=$LAST_PID
run_rank "$NSB" 1 "$VB" ok1 "${FLAGS[@]}"; P1=$LAST_PID
wait "$P0"; rc0=$?
wait "$P1"; rc1=$?
[[ $rc0 == 0 && $rc1 == 0 ]] || fail "collectives across namespaces: rank 0 rc=$rc0, rank 1 rc=$rc1"
h0=$(grep '^hash ' "$TMP/ok0.out"); h1=$(grep '^hash ' "$TMP/ok1.out")
ref=$("$TOOL" --reference --world 2 "${FLAGS[@]}") || fail "reference run"
[[ -n $h0 && $h0 == "$h1" ]] || fail "ranks disagree: '$h0' vs '$h1'"
[[ $h0 == "$ref" ]] || fail "ranks' '$h0' differs from the single-process reference '$ref'"
sent_a=$(($(tx_bytes "$NSA" "$VA") - tx_a0)); sent_b=$(($(tx_bytes "$NSB" "$VB") - tx_b0))
# Each rank sends at least half of every reduced buffer to the other.
min=$((SIZE * 4))
((sent_a > min && sent_b > min)) || fail "too little traffic on the veth pair ($sent_a / $sent_b bytes)"
echo "collectives: both ranks $h0 == reference; veth carried $sent_a + $sent_b bytes"

# --- 2. a rank killed mid-run --------------------------------------------------------
for victim in 1 0; do
  survivor=$((1 - victim))
  KILL_FLAGS=(--check allreduce --size 262144 --iters 1000000 --timeout-ms "$CALL_TIMEOUT_MS")
  declare -A P=()
  for r in 0 1; do
    extra=()
    [[ $r == "$victim" ]] && extra=(--die-after-ms 500)
    ns=$NSA; dev=$VA
    [[ $r == 1 ]] && { ns=$NSB; dev=$VB; }
    run_rank "$ns" "$r" "$dev" "kill$victim-$r" "${KILL_FLAGS[@]}" "${extra[@]}"
    P[$r]=$LAST_PID
  done
  wait "${P[$victim]}"; rcv=$?
  died_ms=$(now_ms)
  wait "${P[$survivor]}"; rcs=$?
  took_ms=$(($(now_ms) - died_ms))
  ((rcv == 137)) || fail "victim rank $victim: expected SIGKILL (137), got rc=$rcv"
  ((rcs != 0 && rcs != 137)) || fail "survivor rank $survivor: expected a nonzero exit of its own, got rc=$rcs"
  ((took_ms < CALL_TIMEOUT_MS)) || fail "survivor rank $survivor took ${took_ms} ms after the kill (deadline ${CALL_TIMEOUT_MS} ms)"
  grep -q '^error: ' "$TMP/kill$victim-$survivor.err" || fail "survivor rank $survivor printed no error"
  echo "kill rank $victim: rank $survivor exited rc=$rcs ${took_ms} ms later: $(grep '^error: ' "$TMP/kill$victim-$survivor.err")"
done
echo "ucx_netns: OK"
