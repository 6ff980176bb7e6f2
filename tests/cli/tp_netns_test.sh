#!/usr/bin/env bash
# Tensor parallelism across two "boxes": rank 0 and rank 1 of `generate --tp 2`
# run in two network namespaces joined only by a veth pair, collectives over
# UCX restricted to TCP (UCX_TLS=tcp: no shared memory between the ranks).
# The logits of every generated token must equal TP = 1 within 1e-4 relative
# and the greedy tokens must be identical. Namespaces, links and processes
# are removed on every exit path. Skips (77) without root or `ip netns`.
#   usage: tp_netns_test.sh path/to/exl3serve
set -euo pipefail
BIN=$1
if [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null 2>&1; then
  echo "skip: needs root and iproute2 for network namespaces"; exit 77
fi
TAG="exl3tp$$"
NSA="${TAG}a" NSB="${TAG}b"
SUB=$(( $$ % 200 + 20 ))
ADDR_A="10.213.${SUB}.1" ADDR_B="10.213.${SUB}.2"
WORK=$(mktemp -d)
cleanup() {
  set +e
  for ns in "$NSA" "$NSB"; do
    pids=$(ip netns pids "$ns" 2>/dev/null)
    [ -n "$pids" ] && kill -9 $pids 2>/dev/null
    ip netns del "$ns" 2>/dev/null
  done
  rm -rf "$WORK"
}
trap cleanup EXIT
if ! ip netns add "$NSA" 2>/dev/null; then
  echo "skip: cannot create network namespaces here"; exit 77
fi
ip netns add "$NSB"
ip link add "${TAG}va" type veth peer name "${TAG}vb"
ip link set "${TAG}va" netns "$NSA"
ip link set "${TAG}vb" netns "$NSB"
ip -n "$NSA" addr add "$ADDR_A/24" dev "${TAG}va"
ip -n "$NSB" addr add "$ADDR_B/24" dev "${TAG}vb"
for ns in "$NSA" "$NSB"; do
  ip -n "$ns" link set lo up
done
ip -n "$NSA" link set "${TAG}va" up
ip -n "$NSB" link set "${TAG}vb" up

"$BIN" make-test-model --out "$WORK/hf" --seed 5 >/dev/null
COMMON=(--model "$WORK/hf" --prompt-ids 1,42,7,311,5 --max-tokens 16 --ids --ignore-eos --kv-bits 32)
"$BIN" generate "${COMMON[@]}" --logits-out "$WORK/tp1.npy" >"$WORK/tp1.txt"
export UCX_TLS=tcp
timeout 300 "$BIN" generate "${COMMON[@]}" --tp 2 --comm ucx --ucx-tls tcp \
  --bootstrap "$ADDR_A:$(( 20000 + $$ % 20000 ))" \
  --rank-wrapper "ip netns exec $NSA" --rank-wrapper "ip netns exec $NSB" \
  --step-timeout-ms 30000 --logits-out "$WORK/tp2.npy" >"$WORK/tp2.txt"
echo "TP=1: $(cat "$WORK/tp1.txt")"
echo "TP=2 across namespaces: $(cat "$WORK/tp2.txt")"
cmp "$WORK/tp1.txt" "$WORK/tp2.txt"
/usr/bin/python3 - "$WORK/tp1.npy" "$WORK/tp2.npy" <<'PY'
import sys
import numpy as np
a, b = np.load(sys.argv[1]), np.load(sys.argv[2])
assert a.shape == b.shape, (a.shape, b.shape)
rel = float(np.abs(a - b).max() / np.abs(a).max())
print(f"logits {a.shape}: max relative difference {rel:.3g}")
assert rel <= 1e-4, rel
PY
echo "PASS: TP=2 over UCX/TCP between two network namespaces matches TP=1"
