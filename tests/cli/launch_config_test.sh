#!/usr/bin/env bash
# The cluster YAML's boxes, collective and rank-credential keys as `exl3serve
# launch --dry-run` reads them (cli/launch_command.cc, cli/cluster_keys.h):
# a valid file plans each box (flags and environment of every rank, checked
# exactly), and each broken variant is refused with an error naming its key.
# Starts no process besides exl3serve itself.
set -uo pipefail
BIN=$1
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

cat >"$WORK/good.yaml" <<'YAML'
model_dir: /models/m
world_size: 3
listen_address: 0.0.0.0:50061
comm:
  backend: ucx
  bootstrap_address: "10.0.0.2:50071"
  ucx: {tls: tcp}
  nccl: {net: IB, ib_gid_index: 3, socket_ifname: bond0}
tls:
  rank_cert: /s/endpoint.pem
  rank_key: /s/endpoint.key
  rank_ca: /s/ca.pem
  rank_client_cert: /s/rank.pem
  rank_client_key: /s/rank.key
rank_token_file: /s/token
precision: {prefill: bf16, decode: int8}
boxes:
  - {name: lead, address: 10.0.0.1, coordinator: true, metrics_port: 9400}
  - name: a
    address: 10.0.0.2
    devices: [0, 1, 2]
    nics: [eth1, eth2]
    nccl: {ib_hca: "mlx5_0:1"}
    ranks: [0, 2]
    rank_devices: [2, 0]
    rank_metrics_ports: [9401, 9403]
  - {name: b, address: 10.0.0.3, ranks: [1]}
YAML
"$BIN" launch --config "$WORK/good.yaml" --box a --dry-run >"$WORK/a.out" 2>&1 || { cat "$WORK/a.out"; fail "good config, box a"; }
want0="UCX_NET_DEVICES=eth1,eth2 CUDA_VISIBLE_DEVICES=2 exl3serve worker --coordinator 10.0.0.1:50061 --rank 0 --world-size 3 --reconnect --metrics-port 9401 --metrics-host 10.0.0.2 --tls-ca /s/ca.pem --tls-server-name 10.0.0.1 --tls-cert /s/rank.pem --tls-key /s/rank.key --rank-token-file /s/token --nccl-net IB --nccl-ib-hca mlx5_0:1 --nccl-ib-gid-index 3 --nccl-socket-ifname bond0"
got0=$(sed -n 's/^launch: would run rank 0: //p' "$WORK/a.out")
[ "$got0" = "$want0" ] || fail "rank 0:
 got  $got0
 want $want0"
grep -q "^launch: would run rank 2: UCX_NET_DEVICES=eth1,eth2 CUDA_VISIBLE_DEVICES=0 .*--rank 2 .*--metrics-port 9403" "$WORK/a.out" ||
  { cat "$WORK/a.out"; fail "rank 2"; }
"$BIN" launch --config "$WORK/good.yaml" --box b --dry-run >"$WORK/b.out" 2>&1 || { cat "$WORK/b.out"; fail "box b"; }
got1=$(sed -n 's/^launch: would run rank 1: //p' "$WORK/b.out")
# box b: no NICs, devices or overrides: comm.nccl as it is, no environment
[ "$got1" = "exl3serve worker --coordinator 10.0.0.1:50061 --rank 1 --world-size 3 --reconnect --tls-ca /s/ca.pem --tls-server-name 10.0.0.1 --tls-cert /s/rank.pem --tls-key /s/rank.key --rank-token-file /s/token --nccl-net IB --nccl-ib-gid-index 3 --nccl-socket-ifname bond0" ] ||
  fail "rank 1: $got1"
"$BIN" launch --config "$WORK/good.yaml" --box lead --dry-run >"$WORK/lead.out" 2>&1 || fail "box lead"
grep -q "^launch: would run: exl3serve coordinator --config .* --metrics-port 9400 --metrics-host 10.0.0.1" "$WORK/lead.out" ||
  { cat "$WORK/lead.out"; fail "lead box"; }
echo "launch_config: a valid file plans every box"

bad() {  # pattern python-edit: the edited file must be refused naming the key
  local pattern=$1 edit=$2
  /usr/bin/python3 - "$WORK/good.yaml" "$WORK/bad.yaml" "$edit" <<'PY' || fail "edit $edit"
import sys, yaml
c = yaml.safe_load(open(sys.argv[1]))
exec(sys.argv[3])
yaml.safe_dump(c, open(sys.argv[2], "w"))
PY
  if "$BIN" launch --config "$WORK/bad.yaml" --box a --dry-run >"$WORK/bad.out" 2>&1; then
    fail "accepted: $edit"
  fi
  grep -qF -- "$pattern" "$WORK/bad.out" || { cat "$WORK/bad.out"; fail "$edit: error does not say '$pattern'"; }
  echo "launch_config: refused ($edit): $(grep -o 'error: .*' "$WORK/bad.out" | cut -c8-150)"
}
bad 'unknown config key `comm.nccl.ib_gdi_index`' 'c["comm"]["nccl"]["ib_gdi_index"] = 3'
bad 'config key `comm.nccl.ib_gid_index` must be 0..255' 'c["comm"]["nccl"]["ib_gid_index"] = 300'
bad 'unknown config key `boxes[1].nccl.hca`' 'c["boxes"][1]["nccl"] = {"hca": "x"}'
bad 'unknown config key `boxes[1].gpus`' 'c["boxes"][1]["gpus"] = [0]'
bad 'unknown config key `comm.ucx.transports`' 'c["comm"]["ucx"] = {"transports": "tcp"}'
bad 'config keys `comm.ucx.tls` ("tcp") and `comm.ucx_tls` ("rc") disagree' 'c["comm"]["ucx_tls"] = "rc"'
bad 'config key `boxes[1].rank_devices[0]` must be one of boxes[1].devices, got 7' 'c["boxes"][1]["rank_devices"] = [7, 0]'
bad 'config key `boxes[1].rank_devices` must have one device per entry of ranks' 'c["boxes"][1]["rank_devices"] = [0]'
bad 'config key `boxes[1].devices[1]` must be a CUDA device id >= 0, unique' 'c["boxes"][1]["devices"] = [0, 0]'
bad 'config key `boxes[1].nics[0]` must be one interface name' 'c["boxes"][1]["nics"] = ["eth1,eth2"]'
bad 'config key `tls.rank_ca` is required with tls.rank_cert' 'del c["tls"]["rank_ca"]'
bad 'config keys `tls.rank_client_cert` and `tls.rank_client_key` go together' 'del c["tls"]["rank_client_key"]'
bad 'unknown config key `tls.rank_client_ca`' 'c["tls"]["rank_client_ca"] = "/s/ca.pem"'
bad 'config key `precision.decode` must be fp32 or int8, got "int4"' 'c["precision"]["decode"] = "int4"'
bad 'config key `precision.prefill` must be fp32 or bf16, got "int8"' 'c["precision"]["prefill"] = "int8"'
bad 'unknown config key `precision.mode`' 'c["precision"]["mode"] = "fast"'
bad 'config key `listen_address`: refusing to listen for ranks on 0.0.0.0 without credentials' 'del c["tls"]; del c["rank_token_file"]'
bad 'config key `listen_address` is loopback (127.0.0.1:50061) but box "a" has ranks' 'c["listen_address"] = "127.0.0.1:50061"'
# TLS with a token but no client certificate is enough; so is the explicit opt-out.
/usr/bin/python3 -c '
import sys, yaml
c = yaml.safe_load(open(sys.argv[1])); del c["tls"]["rank_client_cert"]; del c["tls"]["rank_client_key"]
yaml.safe_dump(c, open(sys.argv[2], "w"))
c = yaml.safe_load(open(sys.argv[1])); del c["tls"]; del c["rank_token_file"]; c["insecure_rank_listen_any"] = True
yaml.safe_dump(c, open(sys.argv[3], "w"))' "$WORK/good.yaml" "$WORK/token-only.yaml" "$WORK/optout.yaml"
"$BIN" launch --config "$WORK/token-only.yaml" --box a --dry-run >/dev/null 2>&1 || fail "TLS + token (no client certificate) refused"
"$BIN" launch --config "$WORK/optout.yaml" --box a --dry-run >"$WORK/optout.out" 2>&1 || fail "insecure_rank_listen_any refused"
grep -q -- "--tls-ca" "$WORK/optout.out" && fail "credentials flags without credentials"
echo PASS
