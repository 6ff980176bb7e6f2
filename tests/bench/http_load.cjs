// http_load: N concurrent SSE streams against an OpenAI-compatible
// /v1/completions (plain fetch, no client library: what it measures is the
// server's HTTP path). Each stream sends a random token-id prompt of P tokens
// with ignore_eos and max_tokens G, back to back, R requests in all; prints
// one JSON line: requests ok / failed, output tokens/s, TTFT and inter-token
// latency p50/p99 (the gap between content chunks, divided among their
// tokens, as bench-serve does; chunks are counted by their token_ids, so a
// model without a tokenizer, whose text is empty, is measured too).
//   node http_load.cjs BASE_URL CONCURRENCY PROMPT_LEN GEN_LEN REQUESTS [VOCAB]
'use strict';
const [base, conc, plen, glen, reqs, vocabArg] = process.argv.slice(2);
const C = Number(conc), P = Number(plen), G = Number(glen), R = Number(reqs), V = Number(vocabArg || 512);
let next = 0, ok = 0, failed = 0, tokens = 0;
const ttft = [], itl = [], errors = [];
let seed = 12345;
const rand = () => (seed = (seed * 1103515245 + 12345) % 2147483648) / 2147483648;

async function one() {
  const prompt = Array.from({ length: P }, () => Math.floor(rand() * V));
  const t0 = performance.now();
  const res = await fetch(base + '/completions', {
    method: 'POST', headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ prompt, max_tokens: G, ignore_eos: true, temperature: 0, stream: true,
                           return_token_ids: true, stream_options: { include_usage: true } }),
  });
  if (res.status !== 200) throw new Error(`HTTP ${res.status}: ${await res.text()}`);
  const decoder = new TextDecoder();
  let buf = '', last = null, n = 0, done = false;
  for await (const bytes of res.body) {
    buf += decoder.decode(bytes, { stream: true });
    let cut;
    while ((cut = buf.indexOf('\n\n')) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      if (!event.startsWith('data: ')) continue;
      const data = event.slice(6);
      if (data === '[DONE]') { done = true; continue; }
      const j = JSON.parse(data);
      if (j.error) throw new Error(JSON.stringify(j.error));
      if (j.usage) { n = j.usage.completion_tokens; continue; }
      const now = performance.now();
      const k = (j.choices[0].token_ids || []).length;  // tokens in this chunk
      if (k === 0) continue;
      if (last === null) ttft.push(now - t0);
      else for (let i = 0; i < k; i++) itl.push((now - last) / k);
      last = now;
    }
  }
  if (!done) throw new Error('stream ended without [DONE]');
  tokens += n;
}

async function worker() {
  while (next < R) {
    next++;
    try { await one(); ok++; } catch (e) { failed++; if (errors.length < 3) errors.push(String(e)); }
  }
}

const q = (a, p) => { if (!a.length) return 0; const s = [...a].sort((x, y) => x - y); return s[Math.min(s.length - 1, Math.floor(p * s.length))]; };
(async () => {
  const t0 = performance.now();
  await Promise.all(Array.from({ length: C }, worker));
  const wall = (performance.now() - t0) / 1000;
  console.log(JSON.stringify({ concurrency: C, ok, failed, errors, wall_s: +wall.toFixed(2),
    tokens_per_s: +(tokens / wall).toFixed(1), ttft_p50_ms: +q(ttft, 0.5).toFixed(1), ttft_p99_ms: +q(ttft, 0.99).toFixed(1),
    itl_p50_ms: +q(itl, 0.5).toFixed(2), itl_p99_ms: +q(itl, 0.99).toFixed(2) }));
})();
