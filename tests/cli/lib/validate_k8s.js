// node validate_k8s.js NODE_MODULES OBJECTS.json: validates every Kubernetes
// object (a JSON array) against its OpenAPI schema with kubernetes-models,
// offline. LeaderWorkerSet (a CRD without a published model): its two pod
// templates as core/v1 PodTemplateSpec plus the known top-level fields.
// Prints one line per object; exit 1 on the first invalid one.
const path = require('path');
const [modules, file] = process.argv.slice(2);
const req = (p) => require(path.join(modules, p));
const objects = JSON.parse(require('fs').readFileSync(file, 'utf8'));
const fail = (what, err) => { console.error(`INVALID ${what}: ${err.message || err}`); process.exit(1); };
const only = (obj, keys, what) => {
  for (const k of Object.keys(obj || {})) if (!keys.includes(k)) fail(what, `unknown field ${k}`);
};
for (const o of objects) {
  const what = `${o.kind}/${o.metadata && o.metadata.name}`;
  if (o.apiVersion === 'leaderworkerset.x-k8s.io/v1' && o.kind === 'LeaderWorkerSet') {
    only(o, ['apiVersion', 'kind', 'metadata', 'spec'], what);
    only(o.spec, ['replicas', 'leaderWorkerTemplate', 'rolloutStrategy', 'startupPolicy',
                  'networkConfig'], what + '.spec');
    const t = o.spec.leaderWorkerTemplate;
    only(t, ['leaderTemplate', 'workerTemplate', 'size', 'restartPolicy', 'subGroupPolicy',
             'volumeClaimTemplates'], what + '.spec.leaderWorkerTemplate');
    if (!['RecreateGroupOnPodRestart', 'None', undefined].includes(t.restartPolicy)) fail(what, 'restartPolicy');
    if (!['LeaderCreated', 'LeaderReady', undefined].includes(o.spec.startupPolicy)) fail(what, 'startupPolicy');
    if (!Number.isInteger(t.size) || t.size < 1) fail(what, 'size');
    const { PodTemplateSpec } = req('kubernetes-models/v1/PodTemplateSpec');
    for (const k of ['leaderTemplate', 'workerTemplate']) {
      try { new PodTemplateSpec(t[k]).validate(); } catch (e) { fail(`${what}.${k}`, e); }
    }
    console.log(`valid ${what} (pod templates as v1 PodTemplateSpec)`);
    continue;
  }
  const group = o.apiVersion.includes('/') ? o.apiVersion : `v1`;
  let mod;
  try { mod = req(`kubernetes-models/${group}/${o.kind}`); } catch (e) { fail(what, `no schema for ${o.apiVersion} ${o.kind}`); }
  try { new mod[o.kind](o).validate(); } catch (e) { fail(what, e); }
  console.log(`valid ${what}`);
}
