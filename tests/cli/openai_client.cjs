// The official openai npm client (6.49.0) against exl3serve's HTTP API
// (run by tests/cli/openai_client_test.sh with NODE_PATH at its install):
//   node openai_client.cjs REAL_BASE SCRIPTED_BASE TOKEN SCRIPTED_PID
// REAL_BASE: `serve --tp 2 --http-port` on the Qwen3 demo model (bearer TOKEN,
// --max-running 1 --max-queue 1); SCRIPTED_BASE: tests/http's scripted engine
// (tool calls and reasoning a random model cannot produce; SIGUSR1 toggles its
// readiness). Every check throws on failure; the last line is "ok N checks".
'use strict';
const OpenAI = require('openai');
const assert = require('node:assert/strict');

const [REAL, SCRIPTED, TOKEN, SCRIPTED_PID] = process.argv.slice(2);
let checks = 0;
function check(cond, what) {
  assert.ok(cond, what);
  checks++;
}

// Counts the HTTP requests a client makes (to see that a 400 is not retried).
function countingFetch() {
  const f = async (url, init) => {
    f.calls++;
    return fetch(url, init);
  };
  f.calls = 0;
  return f;
}

async function expectStatus(promise, status, cls, what) {
  try {
    await promise;
  } catch (e) {
    check(e instanceof OpenAI.APIError, `${what}: an APIError (got ${e})`);
    check(e.status === status, `${what}: status ${status}, got ${e.status}: ${e.message}`);
    check(e instanceof cls, `${what}: ${cls.name}, got ${e.constructor.name}`);
    check(e.error === undefined || typeof e.error.message === 'string', `${what}: error.message`);
    return e;
  }
  throw new Error(`${what}: expected HTTP ${status}, the call succeeded`);
}

async function metricsText(base) {
  const r = await fetch(base.replace(/\/v1$/, '') + '/metrics');
  return r.text();
}
function metricValue(text, name, labelPart) {
  let total = 0;
  for (const line of text.split('\n')) {
    if (line.startsWith(name) && line.includes(labelPart)) total += Number(line.split(' ').pop());
  }
  return total;
}

async function realServer() {
  const client = new OpenAI({ baseURL: REAL, apiKey: TOKEN, maxRetries: 0, timeout: 60000 });
  const models = await client.models.list();
  check(models.data.length >= 1, 'models.list has the model');
  const model = models.data[0].id;
  check(typeof models.data[0].max_model_len === 'number', 'model card max_model_len');
  const one = await client.models.retrieve(model);
  check(one.id === model, 'models.retrieve');
  await expectStatus(client.models.retrieve('no-such-model'), 404, OpenAI.NotFoundError, 'unknown model card');

  const messages = [{ role: 'system', content: 'You are terse.' }, { role: 'user', content: 'Say hello.' }];
  const base = { model, messages, max_tokens: 12, temperature: 0 };
  const whole = await client.chat.completions.create(base);
  const text = whole.choices[0].message.content;
  check(typeof text === 'string' && text.length > 0, 'chat: content');
  check(['stop', 'length'].includes(whole.choices[0].finish_reason), 'chat: finish_reason');
  check(whole.usage && whole.usage.completion_tokens > 0 && whole.usage.prompt_tokens > 0, 'chat: usage');
  check(whole.usage.prompt_tokens_details.cached_tokens === 0, 'chat: cached_tokens');
  check(whole.id.startsWith('chatcmpl-') && whole.object === 'chat.completion', 'chat: id/object');

  // Streamed: the same text (greedy), role first, finish_reason last, usage chunk.
  const stream = await client.chat.completions.create({ ...base, stream: true, stream_options: { include_usage: true } });
  let streamed = '', sawRole = false, finish = null, usage = null, chunks = 0;
  for await (const c of stream) {
    chunks++;
    if (c.usage) {
      usage = c.usage;
      check(c.choices.length === 0, 'usage chunk has choices: []');
      continue;
    }
    const d = c.choices[0].delta;
    if (d.role) sawRole = true;
    if (d.content) streamed += d.content;
    if (c.choices[0].finish_reason) finish = c.choices[0].finish_reason;
  }
  check(sawRole && finish !== null && chunks >= 3, 'stream: role and finish_reason');
  check(streamed === text, `stream text == non-stream text (${JSON.stringify(streamed)} vs ${JSON.stringify(text)})`);
  check(usage && usage.completion_tokens === whole.usage.completion_tokens, 'stream: usage chunk');
  // The same prompt again: the server's prefix cache holds its full 16-token
  // blocks (at least one prompt token is always computed).
  const cachedWant = Math.floor((whole.usage.prompt_tokens - 1) / 16) * 16;
  check(usage.prompt_tokens_details.cached_tokens === cachedWant,
        `stream: cached_tokens ${usage.prompt_tokens_details.cached_tokens}, want ${cachedWant} of ${whole.usage.prompt_tokens}`);

  // The client's own accumulator validates role / finish_reason on every choice.
  const final = await client.chat.completions.stream(base).finalChatCompletion();
  check(final.choices[0].message.content === text, 'stream().finalChatCompletion() content');

  // Completions, streamed and not.
  const comp = await client.completions.create({ model, prompt: 'Hello', max_tokens: 8, temperature: 0 });
  check(comp.object === 'text_completion' && comp.choices[0].text.length > 0, 'completions');
  let compStreamed = '';
  for await (const c of await client.completions.create({ model, prompt: 'Hello', max_tokens: 8, temperature: 0, stream: true })) {
    compStreamed += c.choices[0]?.text ?? '';
  }
  check(compStreamed === comp.choices[0].text, 'completions stream == non-stream');

  // Logprobs: one entry per generated token, top_logprobs alternatives sorted.
  const lp = await client.chat.completions.create({ ...base, logprobs: true, top_logprobs: 3 });
  const content = lp.choices[0].logprobs.content;
  check(content.length === lp.usage.completion_tokens, 'logprobs: one per token');
  for (const e of content) {
    check(e.top_logprobs.length === 3 && e.logprob <= 0 && Array.isArray(e.bytes), 'logprobs entry');
    check(e.top_logprobs[0].logprob >= e.top_logprobs[2].logprob, 'top_logprobs sorted');
  }

  // Seeds: the same seed gives the same tokens at temperature 1.
  const seeded = { ...base, temperature: 1.0, top_p: 0.95, seed: 1234, max_tokens: 16 };
  const s1 = await client.chat.completions.create(seeded);
  const s2 = await client.chat.completions.create(seeded);
  check(s1.choices[0].message.content === s2.choices[0].message.content, 'seed: reproducible');

  // Errors: each status its class; a 400 is not retried even with retries on.
  const counting = countingFetch();
  const retrying = new OpenAI({ baseURL: REAL, apiKey: TOKEN, maxRetries: 2, fetch: counting });
  await expectStatus(retrying.chat.completions.create({ ...base, temperature: 7 }), 400, OpenAI.BadRequestError, 'bad temperature');
  check(counting.calls === 1, `a 400 is not retried (${counting.calls} calls)`);
  await expectStatus(client.chat.completions.create({ ...base, model: 'gpt-nope' }), 404, OpenAI.NotFoundError, 'unknown model');
  const wrongKey = new OpenAI({ baseURL: REAL, apiKey: 'wrong', maxRetries: 0 });
  await expectStatus(wrongKey.chat.completions.create(base), 401, OpenAI.AuthenticationError, 'wrong key');
  await expectStatus(client.chat.completions.create({ ...base, messages: [{ role: 'user', content: 'x'.repeat(10 << 20) }] }),
    413, OpenAI.APIError, '10 MB body');
  await expectStatus(client.embeddings.create({ model, input: 'x' }), 501, OpenAI.InternalServerError, 'embeddings');

  // 429: one running (max_running 1), one waiting (max_queue 1), the third refused.
  const long = { ...base, max_tokens: 400, ignore_eos: true, stream: true };
  const first = await client.chat.completions.create(long);
  const it1 = first[Symbol.asyncIterator]();
  for (;;) {  // until a content token: the first is running
    const { value } = await it1.next();
    if (value.choices[0]?.delta?.content) break;
  }
  const second = await client.chat.completions.create(long);
  const it2 = second[Symbol.asyncIterator]();
  await it2.next();  // its role chunk: it is queued
  const e429 = await expectStatus(client.chat.completions.create(base), 429, OpenAI.RateLimitError, 'queue full');
  check(e429.headers.get('retry-after') === '1', 'Retry-After on 429');
  // break -> both requests aborted on the server (metrics count them).
  const before = await metricsText(REAL);
  await it1.return();
  await it2.return();
  const disconnectsBefore = metricValue(before, 'exl3serve:http_client_disconnects_total', 'chat/completions');
  const deadline = Date.now() + 20000;
  let after;
  for (;;) {
    after = await metricsText(REAL);
    if (metricValue(after, 'exl3serve:http_client_disconnects_total', 'chat/completions') >= disconnectsBefore + 2 &&
        metricValue(after, 'exl3serve:num_requests_running', '') === 0) break;
    if (Date.now() > deadline) throw new Error('aborts not seen in /metrics:\n' + after);
    await new Promise((r) => setTimeout(r, 100));
  }
  check(metricValue(after, 'exl3serve:request_success_total', 'finished_reason="abort"') >= 1, 'abort counted');
  check(metricValue(after, 'exl3serve:http_requests_total', 'status="429"') >= 1, 'http 429 counted');

  // enable_thinking reaches the template (Qwen3 adds an empty think block when false).
  const tok = async (kwargs) => (await (await fetch(REAL.replace(/\/v1$/, '') + '/tokenize', {
    method: 'POST', headers: { 'content-type': 'application/json', authorization: `Bearer ${TOKEN}` },
    body: JSON.stringify({ model, messages, add_generation_prompt: true, chat_template_kwargs: kwargs }),
  })).json()).count;
  const on = await tok({ enable_thinking: true }), off = await tok({ enable_thinking: false });
  check(off > on, `enable_thinking=false renders the empty think block (${off} vs ${on} tokens)`);
}

async function scriptedServer() {
  const client = new OpenAI({ baseURL: SCRIPTED, apiKey: 'unused', maxRetries: 0 });
  const tools = [{ type: 'function', function: { name: 'get_weather', description: 'Weather of a city',
    parameters: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] } } }];
  const ask = [{ role: 'user', content: 'What is the weather in Paris?' }];
  const r = await client.chat.completions.create({ model: 'scripted', messages: ask, tools });
  const m = r.choices[0].message;
  check(r.choices[0].finish_reason === 'tool_calls', 'tool call: finish_reason');
  check(m.tool_calls.length === 1 && m.tool_calls[0].function.name === 'get_weather', 'tool call: name');
  check(JSON.parse(m.tool_calls[0].function.arguments).city === 'Paris', 'tool call: arguments');
  // Streamed, through the client's validating accumulator.
  const final = await client.chat.completions.stream({ model: 'scripted', messages: ask, tools }).finalChatCompletion();
  const fm = final.choices[0].message;
  check(fm.tool_calls[0].function.arguments === m.tool_calls[0].function.arguments, 'streamed tool call == non-stream');
  check(final.choices[0].finish_reason === 'tool_calls', 'streamed finish_reason tool_calls');
  // The tool result goes back through the template.
  const back = await client.chat.completions.create({ model: 'scripted', tools, messages: [
    ...ask, { role: 'assistant', content: null, tool_calls: m.tool_calls },
    { role: 'tool', tool_call_id: m.tool_calls[0].id, content: '{"sky": "clear", "celsius": 21}' }] });
  check(back.choices[0].message.content === 'It is sunny in Paris.', 'tool round trip answer');
  check(back.choices[0].finish_reason === 'stop', 'tool round trip finish');
  // Reasoning: both field names, streamed and not.
  const think = await client.chat.completions.create({ model: 'scripted', messages: [{ role: 'user', content: 'think: 2+2?' }] });
  check(think.choices[0].message.reasoning_content === 'Two and two.' && think.choices[0].message.reasoning === 'Two and two.', 'reasoning split');
  check(think.choices[0].message.content === 'Four.', 'content after reasoning');
  let reasoning = '';
  for await (const c of await client.chat.completions.create({ model: 'scripted', stream: true, messages: [{ role: 'user', content: 'think: 2+2?' }] })) {
    reasoning += c.choices[0]?.delta?.reasoning_content ?? '';
  }
  check(reasoning === 'Two and two.', 'streamed reasoning deltas');
  // n: two choices.
  const two = await client.chat.completions.create({ model: 'scripted', messages: [{ role: 'user', content: 'hi' }], n: 2, seed: 5 });
  check(two.choices.length === 2 && two.choices[1].index === 1, 'n = 2');
  // 503 with Retry-After while not ready (SIGUSR1 toggles the scripted engine).
  // The signal is handled asynchronously: wait (bounded) until /health says so.
  const health = async (want) => {
    const until = Date.now() + 10000;
    for (;;) {
      const r = await fetch(SCRIPTED.replace(/\/v1$/, '') + '/health');
      if (r.status === want) return;
      if (Date.now() > until) throw new Error(`/health never became ${want}`);
      await new Promise((res) => setTimeout(res, 20));
    }
  };
  process.kill(Number(SCRIPTED_PID), 'SIGUSR1');
  await health(503);
  const e503 = await expectStatus(client.chat.completions.create({ model: 'scripted', messages: ask }), 503,
    OpenAI.InternalServerError, 'not ready');
  check(e503.headers.get('retry-after') === '5', 'Retry-After on 503');
  process.kill(Number(SCRIPTED_PID), 'SIGUSR1');
  await health(200);
}

(async () => {
  await realServer();
  await scriptedServer();
  console.log(`ok ${checks} checks`);
})().catch((e) => {
  console.error('FAIL:', e && e.stack ? e.stack : e);
  process.exit(1);
});
