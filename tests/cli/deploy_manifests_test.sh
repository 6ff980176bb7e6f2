#!/usr/bin/env bash
# The deployment manifests of deploy/ (kubernetes/, systemd/, compose/),
# offline: yamllint (repo .yamllint) is clean; `kubectl kustomize` renders
# kubernetes/lws and kubernetes/statefulset; every rendered object validates
# against its Kubernetes schema (npm kubernetes-models, installed once into
# the build dir; tests/cli/lib/validate_k8s.js); every manifest carries
# deploy/cluster/cluster.yaml byte for byte; `exl3serve coordinator --config`
# accepts it (started on loopback with a test model and throwaway rank
# credentials until "listening on"), refuses it without the rank credentials,
# and `launch --dry-run` plans each of its boxes; the probe, Service,
# --coordinator and --metrics ports equal the cluster YAML's, and every rank
# carries the rank credentials the YAML names.
# A missing validator (yamllint, kubectl, node/npm or the network for npm)
# prints SKIP and exits 77 after running the rest.
set -uo pipefail
BIN=$1
SRC=${EXL3_SOURCE_DIR:?}
BUILD=${EXL3_BUILD_DIR:?}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
skipped=()
CLUSTER=$SRC/deploy/cluster/cluster.yaml

# 1. yamllint.
if command -v yamllint >/dev/null; then
  (cd "$SRC" && yamllint -c .yamllint deploy .yamllint) || fail "yamllint"
  echo "ok: yamllint clean"
else
  skipped+=("yamllint not installed (scripts/install-deps.sh)")
fi

# 2. The cluster YAML: accepted by the coordinator (loopback, a test model,
# throwaway rank credentials in place of /etc/exl3serve-secrets/).
"$BIN" make-test-model --arch llama --out "$WORK/model" >/dev/null || fail "make-test-model"
if command -v openssl >/dev/null; then
  S=$WORK/secrets
  mkdir -p "$S"
  ossl() { openssl "$@" >/dev/null 2>&1 || fail "openssl $*"; }
  ossl req -x509 -newkey rsa:2048 -nodes -keyout "$S/ca.key" -out "$S/cluster-ca.pem" -days 2 -subj /CN=ca \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"
  for n in rank-endpoint rank; do
    ossl req -newkey rsa:2048 -nodes -keyout "$S/$n.key" -out "$S/$n.csr" -subj "/CN=exl3serve-leader"
    ossl x509 -req -in "$S/$n.csr" -CA "$S/cluster-ca.pem" -CAkey "$S/ca.key" -CAcreateserial \
      -out "$S/$n.pem" -days 2
  done
  echo "token-$RANDOM" >"$S/rank-token"
  sed -e "s#^model_dir: .*#model_dir: $WORK/model#" -e "s#/etc/exl3serve-secrets/#$S/#" \
      -e 's#^\(listen_address\|api_address\): .*#\1: 127.0.0.1:0#' "$CLUSTER" >"$WORK/cluster.yaml"
else
  skipped+=("openssl not installed: the rank credentials are dropped for the coordinator check")
  sed -e "s#^model_dir: .*#model_dir: $WORK/model#" -e '/^  rank_/d' -e '/^rank_token_file:/d' -e '/^tls:/d' \
      -e 's#^\(listen_address\|api_address\): .*#\1: 127.0.0.1:0#' "$CLUSTER" >"$WORK/cluster.yaml"
fi
"$BIN" coordinator --config "$WORK/cluster.yaml" >"$WORK/coord.out" 2>&1 &
pid=$!
for _ in $(seq 100); do grep -q '^listening on' "$WORK/coord.out" && break; sleep 0.1; done
kill "$pid" 2>/dev/null; wait "$pid"
grep -q '^listening on' "$WORK/coord.out" || { cat "$WORK/coord.out"; fail "coordinator rejected $CLUSTER"; }
echo "ok: exl3serve coordinator accepts deploy/cluster/cluster.yaml"
# ... and a broken key is rejected naming it (so the check above means something).
sed 's#^world_size:#wrold_size:#' "$WORK/cluster.yaml" >"$WORK/bad.yaml"
timeout 10 "$BIN" coordinator --config "$WORK/bad.yaml" >"$WORK/bad.out" 2>&1 && fail "bad config accepted"
grep -q 'wrold_size' "$WORK/bad.out" || fail "bad config error does not name the key"
# The file as it is (not edited): its rank endpoint on every address is
# accepted only with the rank credentials, and `launch --dry-run` plans every
# box (no file is read): each rank gets the credentials, NICs and GPU.
sed -e '/^rank_token_file:/d' -e '/^  rank_/d' -e '/^tls:/d' "$CLUSTER" >"$WORK/open.yaml"
timeout 10 "$BIN" coordinator --config "$WORK/open.yaml" >"$WORK/open.out" 2>&1 && fail "no rank credentials accepted"
grep -q 'config key `listen_address`: refusing to listen for ranks on 0.0.0.0' "$WORK/open.out" ||
  { cat "$WORK/open.out"; fail "no clear error without rank credentials"; }
python3 -c 'import sys,yaml; print(" ".join(b["name"] for b in yaml.safe_load(open(sys.argv[1]))["boxes"]))' \
  "$CLUSTER" >"$WORK/boxes" || fail "boxes"
for box in $(cat "$WORK/boxes"); do
  "$BIN" launch --config "$CLUSTER" --box "$box" --dry-run >"$WORK/launch-$box.out" 2>&1 ||
    { cat "$WORK/launch-$box.out"; fail "launch --dry-run --box $box"; }
  grep '^launch: would run rank' "$WORK/launch-$box.out" | while read -r line; do
    for want in "--tls-ca /etc/exl3serve-secrets/cluster-ca.pem" "--tls-cert /etc/exl3serve-secrets/rank.pem" \
        "--rank-token-file /etc/exl3serve-secrets/rank-token" "--tls-server-name exl3serve-leader" \
        "--nccl-socket-ifname" "CUDA_VISIBLE_DEVICES=" "UCX_NET_DEVICES="; do
      [[ "$line" == *"$want"* ]] || { echo "$line"; exit 1; }
    done
  done || fail "launch --dry-run --box $box: a rank misses its credentials, NICs or GPU"
done
grep -q "^launch: would run: exl3serve coordinator" "$WORK"/launch-*.out || fail "no box runs the coordinator"
timeout 10 "$BIN" launch --config "$CLUSTER" --box nosuch --dry-run >"$WORK/nobox.out" 2>&1 && fail "--box nosuch accepted"
echo "ok: launch --dry-run plans every box of deploy/cluster/cluster.yaml ($(cat "$WORK/boxes"))"

# 3. Render the kustomizations.
rendered=()
if command -v kubectl >/dev/null; then
  for v in lws statefulset; do
    kubectl kustomize "$SRC/deploy/kubernetes/$v" >"$WORK/$v.yaml" || fail "kubectl kustomize $v"
    python3 -c 'import sys,yaml,json; json.dump([d for d in yaml.safe_load_all(open(sys.argv[1])) if d], open(sys.argv[2], "w"))' \
      "$WORK/$v.yaml" "$WORK/$v.json" || fail "parse rendered $v"
    rendered+=("$WORK/$v.json")
  done
  echo "ok: kubectl kustomize renders lws and statefulset"
else
  skipped+=("kubectl not installed: kustomizations not rendered")
fi

# 4. Schemas (kubernetes-models, offline once installed).
if ((${#rendered[@]})); then
  KM=$BUILD/k8s-models
  KM_PKGS=(kubernetes-models@4.5.1 @kubernetes-models/base@5.0.1)
  ok_models=0
  if command -v node >/dev/null && command -v npm >/dev/null; then
    mkdir -p "$KM"
    if [ "$(cat "$KM/installed" 2>/dev/null)" = "${KM_PKGS[*]}" ] ||
       { timeout 300 npm install --no-audit --no-fund --prefix "$KM" "${KM_PKGS[@]}" >"$KM/npm.log" 2>&1 &&
         echo "${KM_PKGS[*]}" >"$KM/installed"; }; then
      ok_models=1
    fi
  fi
  if ((ok_models)); then
    for f in "${rendered[@]}"; do
      node "$SRC/tests/cli/lib/validate_k8s.js" "$KM/node_modules" "$f" || fail "schema: $f"
    done
    echo "ok: every rendered object validates"
  else
    skipped+=("node/npm or network for kubernetes-models unavailable: schemas not checked")
  fi
fi

# 5. Same cluster YAML everywhere, ports consistent.
python3 - "$CLUSTER" "$SRC/deploy" "${rendered[@]}" <<'PY' || fail "consistency"
import json, re, sys, yaml
cluster_path, deploy, *rendered = sys.argv[1:]
text = open(cluster_path).read()
c = yaml.safe_load(text)
port = lambda a: int(a.rsplit(':', 1)[1])
api, ranks, boot = port(c['api_address']), port(c['listen_address']), port(c['comm']['bootstrap_address'])
http = port(c['http_address'])
ws, to = c['world_size'], c.get('timeouts', {})
def die(m): print('FAIL:', m, file=sys.stderr); sys.exit(1)
def check_args(args, where):
    s = ' '.join(args)
    if ' coordinator' in ' ' + s and '--config' in s and '/etc/exl3serve/cluster.yaml' not in s:
        die(f'{where}: coordinator not on /etc/exl3serve/cluster.yaml')
    m = re.search(r'--coordinator[= ]\S+:(\d+)', s)
    if m and int(m.group(1)) != ranks: die(f'{where}: --coordinator port {m.group(1)} != {ranks}')
    m = re.search(r'--world-size[= ](\d+)', s)
    if m and int(m.group(1)) != ws: die(f'{where}: --world-size {m.group(1)} != {ws}')
    if re.search(r'--coordinator[= ]', s):  # a rank: the channel's credentials of cluster.yaml
        tls = c.get('tls', {})
        for flag, want in (('--tls-ca', tls.get('rank_ca')), ('--tls-cert', tls.get('rank_client_cert')),
                           ('--tls-key', tls.get('rank_client_key')),
                           ('--tls-server-name', tls.get('rank_server_name')),
                           ('--rank-token-file', c.get('rank_token_file'))):
            if want and not re.search(rf'{flag}[= ]{re.escape(want)}(?=[\s\'"]|$)', s):
                die(f'{where}: {flag} is not {want} (cluster.yaml)')
for f in rendered:
    objs = json.load(open(f))
    cms = {o['metadata']['name']: o for o in objs if o['kind'] == 'ConfigMap'}
    for cm in cms.values():
        if cm['data'].get('cluster.yaml') != text: die(f'{f}: ConfigMap is not cluster.yaml')
    pods = []
    for o in objs:
        if o['kind'] == 'StatefulSet': pods.append((o['metadata']['name'], o['spec']['template']))
        if o['kind'] == 'LeaderWorkerSet':
            t = o['spec']['leaderWorkerTemplate']
            pods += [('lws-leader', t['leaderTemplate']), ('lws-worker', t['workerTemplate'])]
            if t['size'] * 1 != ws: die(f'LWS size {t["size"]} != world_size {ws} (1 rank per box)')
        if o['kind'] == 'Service':
            for p in o['spec']['ports']:
                if p['name'] == 'api' and p['port'] != api: die(f'{o["metadata"]["name"]}: api port')
                if p['name'] == 'http' and p['port'] != http: die(f'{o["metadata"]["name"]}: http port')
                if p['name'] == 'ranks' and p['port'] != ranks: die(f'{o["metadata"]["name"]}: ranks port')
                if p['name'] == 'ucx-bootstrap' and p['port'] != boot: die('bootstrap port')
    coordinators = 0
    for name, tpl in pods:
        spec = tpl['spec']
        for v in spec.get('volumes', []):
            if 'configMap' in v and v['configMap']['name'] not in cms: die(f'{name}: ConfigMap {v["configMap"]["name"]} not rendered')
        for ctr in spec['containers']:
            args = ctr.get('command', []) + ctr.get('args', [])
            check_args(args, f'{f}:{name}/{ctr["name"]}')
            if 'coordinator' in args[:2]:
                coordinators += 1
                probes = {k: ctr.get(k) for k in ('startupProbe', 'readinessProbe', 'livenessProbe')}
                for k, p in probes.items():
                    if not p or p.get('grpc', {}).get('port') != api: die(f'{name}: {k} is not grpc on {api}')
                live, start = probes['livenessProbe'], probes['startupProbe']
                if live['periodSeconds'] * live['failureThreshold'] * 1000 <= to.get('reform_ms', 60000):
                    die('liveness would kill the coordinator before timeouts.reform_ms')
                if start['periodSeconds'] * start['failureThreshold'] * 1000 < to.get('load_ms', 300000):
                    die('startupProbe is shorter than timeouts.load_ms')
                grace = spec.get('terminationGracePeriodSeconds', 30) * 1000
                if grace <= c.get('shutdown_grace_ms', 5000): die('terminationGracePeriodSeconds <= shutdown_grace_ms')
                ports = {p['containerPort'] for p in ctr['ports']}
                if not {api, ranks, http} <= ports: die('coordinator container ports')
                if not any(m.get('mountPath') == '/dev/shm' for c2 in spec['containers'] for m in c2.get('volumeMounts', [])): pass
            mounts = {m['name']: m for m in ctr.get('volumeMounts', [])}
            if 'coordinator' not in args[:2]:
                shm = [v for v in spec['volumes'] if v['name'] == mounts.get('dshm', {}).get('name')]
                if not shm or shm[0].get('emptyDir', {}).get('medium') != 'Memory' or mounts['dshm']['mountPath'] != '/dev/shm':
                    die(f'{name}/{ctr["name"]}: /dev/shm is not a Memory emptyDir')
        ann = tpl['metadata'].get('annotations', {})
        mports = {p['containerPort'] for ctr in spec['containers'] for p in ctr.get('ports', [])}
        if ann.get('prometheus.io/scrape') != 'true' or int(ann['prometheus.io/port']) not in mports:
            die(f'{name}: prometheus annotations')
    if coordinators != 1: die(f'{f}: {coordinators} coordinator containers')
# compose and systemd
comp = yaml.safe_load(open(f'{deploy}/compose/docker-compose.yaml'))
vols = comp['services']['coordinator']['volumes']
if '../cluster/cluster.yaml:/etc/exl3serve/cluster.yaml:ro' not in vols: die('compose does not mount cluster.yaml')
for n, s in comp['services'].items(): check_args(s['command'], f'compose:{n}')
if f'{api}:{api}' not in comp['services']['rank-0']['ports']: die('compose api port')
if f'{http}:{http}' not in comp['services']['rank-0']['ports']: die('compose http port')
for unit in ('exl3serve-coordinator.service', 'exl3serve-worker@.service'):
    u = open(f'{deploy}/systemd/{unit}').read().replace('\\\n', ' ')
    exec_start = [l for l in u.splitlines() if l.startswith('ExecStart=')][0]
    check_args(exec_start.split(), f'systemd:{unit}')
print('ok: manifests carry deploy/cluster/cluster.yaml; probe/service/rank ports match it')
PY

if ((${#skipped[@]})); then
  printf 'SKIP: %s\n' "${skipped[@]}"; exit 77
fi
echo PASS
