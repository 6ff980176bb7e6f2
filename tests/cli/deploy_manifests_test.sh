#!/usr/bin/env bash
# The deployment manifests of deploy/ (kubernetes/, systemd/, compose/),
# offline: yamllint (repo .yamllint) is clean; `kubectl kustomize` renders
# kubernetes/lws and kubernetes/statefulset; every rendered object validates
# against its Kubernetes schema (npm kubernetes-models, installed once into
# the build dir; tests/cli/lib/validate_k8s.js); every manifest carries
# deploy/cluster/cluster.yaml byte for byte; `exl3serve coordinator --config`
# accepts it (started on loopback with a test model until "listening on"); the
# probe, Service, --coordinator and --metrics ports equal the cluster YAML's.
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

# 2. The cluster YAML: accepted by the coordinator (loopback, a test model).
"$BIN" make-test-model --arch llama --out "$WORK/model" >/dev/null || fail "make-test-model"
sed -e "s#^model_dir: .*#model_dir: $WORK/model#" \
    -e 's#^\(listen_address\|api_address\): .*#\1: 127.0.0.1:0#' "$CLUSTER" >"$WORK/cluster.yaml"
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
                if not {api, ranks} <= ports: die('coordinator container ports')
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
