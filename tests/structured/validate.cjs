// Structured output (issue 20), end to end: every constrained output the
// server returns is checked by a matcher independent of the server's masker.
//
//   node validate.cjs selftest DATA_DIR
//       the data and the checkers on hand-written samples (no server): each
//       schema compiles in ajv (draft 2020-12, strict) and uses only the
//       keywords issue 20 lists; valid samples pass and invalid ones fail;
//       regex/grammar examples match and non-examples do not; the JSON
//       prefix/duplicate-key parser and the recursive checkers agree.
//   node validate.cjs check --data DIR --item KEY --finish F --text FILE [--expect OUTPUTS --mode M]
//       one output obtained elsewhere (the gRPC client), checked the same way.
//   node validate.cjs run --base URL --data DIR --label NAME --tp N [options]
//       sends the suites through the official `openai` npm client and checks
//       every output. Options:
//         --api chat|completions   (default chat)
//         --modes LIST             greedy-alone,greedy-batched,sampled-alone,sampled-batched
//                                  (also greedy-streamed / sampled-streamed: stream: true,
//                                  the same outputs as batched; greedy-n2 / sampled-n2:
//                                  two choices per request, each validated)
//         --suites LIST            schemas,regex,grammar,choice,json_object,tools
//         --errors                 also assert the 400s (unsupported keywords, two constraints, ...)
//         --max-tokens N           (default 128)
//         --vocab-chars FILE       the characters the model's vocabulary can write (a
//                                  vocabulary without byte fallback); an item whose
//                                  sample uses others may be refused (reported, not failed)
//         --min-complete F         fraction of answered requests per mode that must end
//                                  complete rather than at max_tokens (default 0.5)
//         --summary FILE           append the summary rows (TSV) here
//         --log FILE               every request and its outcome (JSONL)
//         --token T                bearer token (default "none")
//         --alone-every M, --alone-offset N
//                                  alone modes run every M-th item only (greedy from
//                                  offset N, sampled from N + M/2): the sequential
//                                  time stays bounded, batched modes run them all
//         --extend-cut N           greedy items cut by max_tokens in greedy-batched are
//                                  sent again with max_tokens N (mode greedy-extended):
//                                  the cut output must be a prefix of the longer one,
//                                  which is validated like any other
//         --known-issues FILE      errors listed there (model, item, message) are
//                                  reported as known, not failed
//         --outputs FILE           write every mode's outputs (by item) as JSON
//         --expect FILE            outputs written by another server (--outputs):
//                                  each mode's must be the same
//
// Checkers: JSON outputs by a strict RFC 8259 parser written here (duplicate
// object keys are invalid: a schema-constrained object must not repeat one)
// and then ajv against the request's schema; regex outputs by JavaScript's
// RegExp as ^(?:pattern)$; GBNF outputs by a RegExp with the same language as
// the grammar (grammars/index.json) or, for the recursive grammars, by the
// recursive-descent checkers below; choices by string equality; tool calls'
// arguments by ajv against the tool's parameters.
//
// An output cut by max_tokens (finish_reason "length") is a prefix, not a
// document: counted apart and checked as a prefix where a checker can (JSON
// syntax, choices, the recursive grammars).
//
// Greedy outputs must be the same alone and batched, and so must seeded
// samples: masking is per sequence, so batching must not change a token.
'use strict';
const fs = require('node:fs');
const path = require('node:path');

// ---------------------------------------------------------------------------
// Strict JSON parser: full documents and prefixes.

class JsonPrefixEnd extends Error {}
class JsonSyntaxError extends Error {}

// Parses `text` as one JSON document (RFC 8259). Throws JsonSyntaxError; in
// prefix mode, running out of text anywhere is a JsonPrefixEnd (a valid
// prefix). Duplicate keys in an object are a syntax error here.
function parseStrictJson(text, prefix = false, stats = {}) {
  let i = 0;
  stats.maxWhitespaceRun = 0;
  const n = text.length;
  const fail = (what) => { throw new JsonSyntaxError(`${what} at offset ${i}: ${JSON.stringify(text.slice(Math.max(0, i - 20), i + 20))}`); };
  const end = () => { if (prefix) throw new JsonPrefixEnd(); fail('unexpected end'); };
  const peek = () => { if (i >= n) end(); return text[i]; };
  const ws = () => {
    const start = i;
    while (i < n && ' \t\n\r'.includes(text[i])) i++;
    stats.maxWhitespaceRun = Math.max(stats.maxWhitespaceRun, i - start);
  };
  const lit = (word, value) => {
    for (let k = 0; k < word.length; k++, i++) {
      if (i >= n) end();
      if (text[i] !== word[k]) fail(`expected ${word}`);
    }
    return value;
  };
  const digits = () => {
    if (i >= n) end();
    if (!/[0-9]/.test(text[i])) fail('expected a digit');
    while (i < n && /[0-9]/.test(text[i])) i++;
  };
  const number = () => {
    const start = i;
    if (text[i] === '-') i++;
    if (peek() === '0') i++;
    else if (/[1-9]/.test(text[i])) digits();
    else fail('expected a digit');
    if (i < n && text[i] === '.') { i++; digits(); }
    if (i < n && (text[i] === 'e' || text[i] === 'E')) {
      i++;
      if (peek() === '+' || text[i] === '-') i++;
      digits();
    }
    return Number(text.slice(start, i));
  };
  const string = () => {
    const start = i;
    i++;  // the opening quote
    for (;;) {
      const c = peek();
      if (c === '"') { i++; break; }
      if (c === '\\') {
        i++;
        const e = peek();
        if (e === 'u') {
          i++;
          for (let k = 0; k < 4; k++, i++) { if (!/[0-9a-fA-F]/.test(peek())) fail('bad \\u escape'); }
        } else if ('"\\/bfnrt'.includes(e)) {
          i++;
        } else {
          fail('bad escape');
        }
        continue;
      }
      if (c.charCodeAt(0) < 0x20) fail('unescaped control character in a string');
      i++;
    }
    return JSON.parse(text.slice(start, i));
  };
  const value = () => {
    ws();
    const c = peek();
    if (c === '{') {
      i++;
      const keys = new Set();
      ws();
      if (peek() === '}') { i++; return; }
      for (;;) {
        ws();
        if (peek() !== '"') fail('expected a key');
        const key = string();
        if (keys.has(key)) fail(`duplicate key ${JSON.stringify(key)}`);
        keys.add(key);
        ws();
        if (peek() !== ':') fail('expected :');
        i++;
        value();
        ws();
        const d = peek();
        if (d === ',') { i++; continue; }
        if (d === '}') { i++; return; }
        fail('expected , or }');
      }
    }
    if (c === '[') {
      i++;
      ws();
      if (peek() === ']') { i++; return; }
      for (;;) {
        value();
        ws();
        const d = peek();
        if (d === ',') { i++; continue; }
        if (d === ']') { i++; return; }
        fail('expected , or ]');
      }
    }
    if (c === '"') return string();
    if (c === 't') return lit('true');
    if (c === 'f') return lit('false');
    if (c === 'n') return lit('null');
    if (c === '-' || /[0-9]/.test(c)) return number();
    fail('expected a value');
  };
  value();
  ws();
  if (i < n) fail('text after the document');
  if (prefix) {
    // A complete document is also a prefix of itself.
    throw new JsonPrefixEnd();
  }
}

// Whitespace between JSON tokens: the masker allows a bounded amount (at most
// a space after ':' and ','); a longer run means the model could pad.
const MAX_WHITESPACE_RUN = 2;

// { ok, error } for a whole document.
function checkJsonDocument(text) {
  try {
    const stats = {};
    parseStrictJson(text, false, stats);
    if (stats.maxWhitespaceRun > MAX_WHITESPACE_RUN) {
      return { ok: false, error: `a run of ${stats.maxWhitespaceRun} whitespace characters between tokens` };
    }
    return { ok: true };
  } catch (e) {
    if (e instanceof JsonSyntaxError) return { ok: false, error: e.message };
    throw e;
  }
}
// { ok, error } for a prefix of a document.
function checkJsonPrefix(text) {
  const stats = {};
  try {
    parseStrictJson(text, true, stats);
  } catch (e) {
    if (e instanceof JsonPrefixEnd) {
      if (stats.maxWhitespaceRun > MAX_WHITESPACE_RUN) {
        return { ok: false, error: `a run of ${stats.maxWhitespaceRun} whitespace characters between tokens` };
      }
      return { ok: true };
    }
    if (e instanceof JsonSyntaxError) return { ok: false, error: e.message };
    throw e;
  }
  return { ok: true };
}

// ---------------------------------------------------------------------------
// Recursive grammars' checkers (grammars/arithmetic.gbnf, balanced.gbnf).

// expr ::= term (("+"|"-") term)*; term ::= factor (("*"|"/") factor)*;
// factor ::= number | "(" expr ")"; number ::= [0-9] | [1-9] [0-9]
function arithmeticFull(s) {
  let i = 0;
  const isDigit = (c) => c !== undefined && c >= '0' && c <= '9';
  function number() {
    if (!isDigit(s[i])) return false;
    if (s[i] !== '0' && isDigit(s[i + 1])) i += 2;
    else i += 1;
    return true;
  }
  function factor() {
    if (s[i] === '(') {
      i++;
      if (!expr()) return false;
      if (s[i] !== ')') return false;
      i++;
      return true;
    }
    return number();
  }
  function term() {
    if (!factor()) return false;
    while (s[i] === '*' || s[i] === '/') { i++; if (!factor()) return false; }
    return true;
  }
  function expr() {
    if (!term()) return false;
    while (s[i] === '+' || s[i] === '-') { i++; if (!term()) return false; }
    return true;
  }
  return expr() && i === s.length;
}
// The same language as a one-counter automaton: a prefix check (and, at the
// end, completeness), cross-checked against arithmeticFull in the selftest.
function arithmeticScan(s) {
  let state = 'operand', depth = 0;  // operand | num1 (one digit 1-9 read) | after
  for (const c of s) {
    const digit = c >= '0' && c <= '9';
    if (state === 'num1' && digit) { state = 'after'; continue; }
    if (state === 'num1') state = 'after';
    if (state === 'operand') {
      if (c === '0') state = 'after';
      else if (digit) state = 'num1';
      else if (c === '(') depth++;
      else return { prefix: false, complete: false };
    } else if ('+-*/'.includes(c)) {
      state = 'operand';
    } else if (c === ')' && depth > 0) {
      depth--;
    } else {
      return { prefix: false, complete: false };
    }
  }
  return { prefix: true, complete: state !== 'operand' && depth === 0 };
}

// root ::= group+; group ::= "(" group* ")" | "[" group* "]"
function balancedFull(s) {
  let i = 0;
  function group() {
    const open = s[i];
    const close = open === '(' ? ')' : open === '[' ? ']' : null;
    if (close === null) return false;
    i++;
    while (s[i] === '(' || s[i] === '[') { if (!group()) return false; }
    if (s[i] !== close) return false;
    i++;
    return true;
  }
  if (!group()) return false;
  while (i < s.length) { if (!group()) return false; }
  return true;
}
function balancedPrefix(s) {
  const stack = [];
  for (const c of s) {
    if (c === '(' || c === '[') stack.push(c);
    else if (c === ')' || c === ']') {
      if (stack.pop() !== (c === ')' ? '(' : '[')) return false;
    } else return false;
  }
  return true;
}

const CHECKERS = {
  arithmetic: { full: arithmeticFull, prefix: (s) => arithmeticScan(s).prefix },
  balanced: { full: balancedFull, prefix: balancedPrefix },
};

// ---------------------------------------------------------------------------
// Data.

// The JSON Schema keywords issue 20 lists (plus the annotations title and
// description): the suite uses no others.
const ALLOWED_KEYWORDS = new Set([
  'type', 'properties', 'required', 'additionalProperties', 'enum', 'const', 'items',
  'minItems', 'maxItems', 'anyOf', 'oneOf', '$ref', '$defs', 'pattern', 'minimum', 'maximum',
  'exclusiveMinimum', 'exclusiveMaximum', 'minLength', 'maxLength', 'title', 'description',
]);
function lintKeywords(schema, where, problems) {
  if (typeof schema !== 'object' || schema === null || Array.isArray(schema)) return;
  for (const [k, v] of Object.entries(schema)) {
    if (!ALLOWED_KEYWORDS.has(k)) problems.push(`${where}: keyword ${k}`);
    if (k === 'properties' || k === '$defs') {
      for (const [name, sub] of Object.entries(v)) lintKeywords(sub, `${where}/${k}/${name}`, problems);
    } else if (k === 'anyOf' || k === 'oneOf') {
      v.forEach((sub, j) => lintKeywords(sub, `${where}/${k}/${j}`, problems));
    } else if (k === 'items') {
      lintKeywords(v, `${where}/items`, problems);
    } else if (k === 'additionalProperties' && v !== false) {
      problems.push(`${where}: additionalProperties other than false`);
    }
  }
}

function loadData(dir) {
  const read = (f) => JSON.parse(fs.readFileSync(path.join(dir, f), 'utf8'));
  const samples = read('schema_samples.json');
  const schemas = fs.readdirSync(path.join(dir, 'schemas')).filter((f) => f.endsWith('.json')).sort()
    .map((f) => {
      const name = f.replace(/\.json$/, '');
      return { name, schema: read(path.join('schemas', f)), samples: samples[name] || { valid: [], invalid: [] } };
    });
  const regexes = read('regex.json');
  const grammarIndex = read(path.join('grammars', 'index.json')).grammars;
  const grammars = grammarIndex.map((g) => ({
    ...g, name: g.file.replace(/\.gbnf$/, ''),
    text: fs.readFileSync(path.join(dir, 'grammars', g.file), 'utf8'),
  }));
  const choices = read('choices.json');
  const tools = read('tools.json');
  const bySchema = Object.fromEntries(schemas.map((s) => [s.name, s]));
  for (const t of tools.tools) {
    if (!bySchema[t.schema]) throw new Error(`tools.json: no schema ${t.schema}`);
    t.parameters = bySchema[t.schema].schema;
    t.samples = bySchema[t.schema].samples;
  }
  return { schemas, samples, regexes, grammars, choices, tools, bySchema };
}

function newAjv() {
  const Ajv2020 = require('ajv/dist/2020');
  // strict: unknown keywords are errors (the suite must mean what ajv checks).
  return new Ajv2020({ strict: true, strictTypes: false, allErrors: true });
}

const wholeRegex = (pattern, flags = '') => new RegExp(`^(?:${pattern})$`, flags);

// ---------------------------------------------------------------------------
// Selftest.

function selftest(dir) {
  const d = loadData(dir);
  const ajv = newAjv();
  let checks = 0;
  const problems = [];
  const expect = (cond, what) => { checks++; if (!cond) problems.push(what); };

  expect(d.schemas.length >= 30, `at least 30 schemas (${d.schemas.length})`);
  for (const s of d.schemas) {
    const lint = [];
    lintKeywords(s.schema, s.name, lint);
    expect(lint.length === 0, `keywords outside issue 20's list: ${lint.join(', ')}`);
    let validate;
    try {
      validate = ajv.compile(s.schema);
    } catch (e) {
      expect(false, `${s.name}: ajv cannot compile it: ${e.message}`);
      continue;
    }
    expect(s.samples.valid.length > 0, `${s.name}: has valid samples`);
    for (const v of s.samples.valid) {
      expect(validate(v), `${s.name}: valid sample ${JSON.stringify(v)} fails: ${ajv.errorsText(validate.errors)}`);
      expect(checkJsonDocument(JSON.stringify(v)).ok, `${s.name}: strict JSON of ${JSON.stringify(v)}`);
    }
    for (const v of s.samples.invalid) expect(!validate(v), `${s.name}: invalid sample ${JSON.stringify(v)} passes`);
  }
  for (const r of d.regexes) {
    const re = wholeRegex(r.pattern, r.flags || '');
    for (const e of r.examples) expect(re.test(e), `regex ${r.name}: example ${JSON.stringify(e)} does not match`);
    for (const e of r.non_examples) expect(!re.test(e), `regex ${r.name}: non-example ${JSON.stringify(e)} matches`);
  }
  for (const g of d.grammars) {
    expect(!!g.regex !== !!g.checker, `grammar ${g.name}: a regex or a checker`);
    const accepts = g.regex ? (s) => wholeRegex(g.regex, g.flags || '').test(s) : CHECKERS[g.checker].full;
    for (const e of g.examples) expect(accepts(e), `grammar ${g.name}: example ${JSON.stringify(e)} refused`);
    for (const e of g.non_examples) expect(!accepts(e), `grammar ${g.name}: non-example ${JSON.stringify(e)} accepted`);
    expect(/^root\s*::=/m.test(g.text), `grammar ${g.name}: has a root rule`);
  }
  // The arithmetic automaton and the recursive-descent checker agree on every
  // string of up to 5 characters over the alphabet (and prefixes extend).
  const alphabet = ['0', '1', '2', '+', '*', '(', ')', 'x'];
  let strings = [''];
  for (let len = 1; len <= 5; len++) {
    const next = [];
    for (const s of strings) for (const c of alphabet) next.push(s + c);
    for (const s of next) {
      const scan = arithmeticScan(s);
      expect(scan.complete === arithmeticFull(s), `arithmetic scan/full disagree on ${s}`);
      if (arithmeticFull(s)) {
        for (let k = 0; k <= s.length; k++) expect(arithmeticScan(s.slice(0, k)).prefix, `arith prefix of ${s}`);
      }
      if (balancedFull(s)) expect(balancedPrefix(s), `balanced prefix ${s}`);
    }
    strings = next;
  }
  // Balanced: full match exactly when a non-empty prefix-valid string closes everything.
  for (const s of ['()', '([])', '(]', '((', '', '][', '()[]', '([)]']) {
    const closed = s.length > 0 && balancedPrefix(s) && (() => {
      let depth = 0;
      for (const c of s) depth += '(['.includes(c) ? 1 : -1;
      return depth === 0;
    })();
    expect(balancedFull(s) === closed, `balanced ${s}`);
  }
  // The strict JSON parser.
  for (const [text, ok] of [['{"a":1}', true], ['{"a":1,"a":2}', false], ['[1, 2 ]', true], ['01', false],
    ['"\\u00e9"', true], ['"a\nb"', false], ['{"a":}', false], ['1.', false], ['-0.5e+3', true], ['[1,]', false],
    [' {} ', true], ['{"a":{"b":[true,false,null]}}', true], ['"\\x"', false], ['{} {}', false],
    ['{"a": 1, "b":  2}', true], ['{"a": 1, "b":   2}', false], ['["   "]', true]]) {
    expect(checkJsonDocument(text).ok === ok, `strict JSON ${text}: ${ok}`);
    expect(!ok || JSON.stringify(JSON.parse(text)) !== undefined, `JSON.parse ${text}`);
  }
  for (const [text, ok] of [['', true], ['{', true], ['{"a', true], ['{"a":', true], ['{"a":1', true],
    ['[1.', true], ['[1e', true], ['[1e-', true], ['tr', true], ['"\\u00', true], ['{"a":1,"a"', false],
    ['{1', false], ['[01', false], ['[1,]', false], ['nul ', false], ['{"a":1}x', false], ['{"a":1} ', true], ['[1,    ', false]]) {
    expect(checkJsonPrefix(text).ok === ok, `JSON prefix ${JSON.stringify(text)}: ${ok}`);
  }
  // Every valid sample's prefixes are JSON prefixes.
  for (const s of d.schemas) {
    for (const v of s.samples.valid) {
      const t = JSON.stringify(v);
      for (let k = 0; k <= t.length; k++) {
        if (!checkJsonPrefix(t.slice(0, k)).ok) { expect(false, `prefix ${k} of ${t}`); break; }
      }
    }
  }
  expect(d.tools.tools.length >= 2, 'tools');
  // known_issues.json names real items.
  const keys = new Set([...[0, 1, 2, 3].map((k) => `json_object/${k}`), ...d.schemas.map((x) => `schemas/${x.name}`), ...d.regexes.map((x) => `regex/${x.name}`),
    ...d.grammars.map((x) => `grammar/${x.name}`), ...d.choices.map((x) => `choice/${x.name}`)]);
  const issuesFile = path.join(dir, 'known_issues.json');
  if (fs.existsSync(issuesFile)) {
    for (const issue of JSON.parse(fs.readFileSync(issuesFile, 'utf8')).issues) {
      expect(issue.id && issue.message && issue.note, `known issue ${issue.id}: id, message and note`);
      if (issue.items !== '*') {
        for (const k of issue.items) expect(keys.has(k) || k.startsWith('errors/'), `known issue ${issue.id}: no item ${k}`);
      }
    }
  }
  if (problems.length) {
    for (const p of problems) console.error('selftest:', p);
    console.error(`selftest: ${problems.length} of ${checks} checks failed`);
    process.exit(1);
  }
  console.log(`selftest: ok (${d.schemas.length} schemas, ${d.regexes.length} regexes, ${d.grammars.length} grammars, ` +
    `${d.choices.length} choice lists, ${d.tools.tools.length} tools; ${checks} checks)`);
}

// ---------------------------------------------------------------------------
// Run against a server.

function parseArgs(argv) {
  const o = {
    api: 'chat', modes: 'greedy-alone,greedy-batched,sampled-alone,sampled-batched',
    suites: 'schemas,regex,grammar,choice,json_object,tools', maxTokens: 128, minComplete: 0.5,
    token: 'none', errors: false, aloneEvery: 1, aloneOffset: 0,
  };
  for (let k = 0; k < argv.length; k++) {
    const a = argv[k];
    const v = () => argv[++k];
    switch (a) {
      case '--base': o.base = v(); break;
      case '--data': o.data = v(); break;
      case '--label': o.label = v(); break;
      case '--tp': o.tp = v(); break;
      case '--api': o.api = v(); break;
      case '--modes': o.modes = v(); break;
      case '--suites': o.suites = v(); break;
      case '--errors': o.errors = true; break;
      case '--max-tokens': o.maxTokens = Number(v()); break;
      case '--vocab-chars': o.vocabChars = new Set(Array.from(fs.readFileSync(v(), 'utf8'))); break;
      case '--min-complete': o.minComplete = Number(v()); break;
      case '--summary': o.summary = v(); break;
      case '--log': o.log = v(); break;
      case '--token': o.token = v(); break;
      case '--alone-every': o.aloneEvery = Number(v()); break;
      case '--extend-cut': o.extendCut = Number(v()); break;
      case '--alone-offset': o.aloneOffset = Number(v()); break;
      case '--known-issues': o.knownIssues = JSON.parse(fs.readFileSync(v(), 'utf8')).issues; break;
      case '--outputs': o.outputs = v(); break;
      case '--expect': o.expect = v(); break;
      default: throw new Error(`unknown argument ${a}`);
    }
  }
  for (const k of ['base', 'data', 'label', 'tp']) if (!o[k]) throw new Error(`--${k} is required`);
  o.modes = o.modes.split(',');
  o.suites = o.suites.split(',');
  return o;
}

// Whether the vocabulary can write `text` (every character has a token of its own).
function writable(opts, texts) {
  if (!opts.vocabChars) return true;
  return texts.some((t) => Array.from(t).every((c) => opts.vocabChars.has(c)));
}

// The requests of the suites: { suite, name, body (constraint fields), check(output) }.
function buildItems(d, opts, ajv) {
  const items = [];
  const chat = opts.api === 'chat';
  if (opts.suites.includes('schemas')) {
    d.schemas.forEach((s, idx) => {
      const validate = ajv.compile(s.schema);
      // Each way of sending a schema in turn.
      const how = ['response_format', 'guided_json', 'guided_json_string'][idx % 3];
      const body = how === 'response_format'
        ? { response_format: { type: 'json_schema', json_schema: { name: s.name, schema: s.schema, strict: true } } }
        : { guided_json: how === 'guided_json' ? s.schema : JSON.stringify(s.schema) };
      items.push({
        suite: 'schemas', key: `schemas/${s.name}`, name: `${s.name} (${how})`, body,
        prompt: `Reply with a JSON value: ${s.schema.title || s.name}.`,
        satisfiable: writable(opts, s.samples.valid.map((v) => JSON.stringify(v))),
        full: (t) => jsonCheck(t, validate, ajv),
        prefix: (t) => checkJsonPrefix(t),
      });
    });
  }
  if (opts.suites.includes('json_object')) {
    const validate = ajv.compile({ type: 'object' });
    for (const [k, topic] of ['a user', 'the weather', 'a book', 'an error'].entries()) {
      items.push({
        suite: 'json_object', key: `json_object/${k}`, name: `json_object ${k}`, body: { response_format: { type: 'json_object' } },
        prompt: `Describe ${topic} as a JSON object.`,
        satisfiable: writable(opts, ['{}']),
        full: (t) => jsonCheck(t, validate, ajv),
        prefix: (t) => checkJsonPrefix(t),
      });
    }
  }
  if (opts.suites.includes('regex')) {
    for (const r of d.regexes) {
      const re = wholeRegex(r.pattern, r.flags || '');
      items.push({
        suite: 'regex', key: `regex/${r.name}`, name: r.name, body: { guided_regex: r.pattern },
        prompt: `Write something matching ${r.name}.`,
        satisfiable: writable(opts, r.examples),
        full: (t) => (re.test(t) ? { ok: true } : { ok: false, error: `does not match ${re}` }),
        prefix: null,
      });
    }
  }
  if (opts.suites.includes('grammar')) {
    for (const g of d.grammars) {
      const full = g.regex ? (s) => wholeRegex(g.regex, g.flags || '').test(s) : CHECKERS[g.checker].full;
      const prefix = g.checker ? CHECKERS[g.checker].prefix : null;
      items.push({
        suite: 'grammar', key: `grammar/${g.name}`, name: g.name, body: { guided_grammar: g.text },
        prompt: `Write something in the ${g.name} grammar.`,
        satisfiable: writable(opts, g.examples),
        full: (t) => (full(t) ? { ok: true } : { ok: false, error: `refused by ${g.regex ? 'the equivalent regex' : g.checker}` }),
        prefix: prefix && ((t) => (prefix(t) ? { ok: true } : { ok: false, error: `not a prefix (${g.checker})` })),
      });
    }
  }
  if (opts.suites.includes('choice')) {
    for (const c of d.choices) {
      items.push({
        suite: 'choice', key: `choice/${c.name}`, name: c.name, body: { guided_choice: c.choices },
        prompt: `Pick one: ${c.choices.join(', ')}.`,
        satisfiable: writable(opts, c.choices),
        full: (t) => (c.choices.includes(t) ? { ok: true } : { ok: false, error: 'not one of the choices' }),
        prefix: (t) => (c.choices.some((x) => x.startsWith(t)) ? { ok: true } : { ok: false, error: 'not a prefix of a choice' }),
      });
    }
  }
  if (opts.suites.includes('tools') && chat) {
    const tools = d.tools.tools.map((t) => ({
      type: 'function', function: { name: t.name, description: t.description, parameters: t.parameters },
    }));
    const validators = Object.fromEntries(d.tools.tools.map((t) => [t.name, ajv.compile(t.parameters)]));
    const choicesList = [['required', 'required']].concat(d.tools.tools.map((t) => [t.name, { type: 'function', function: { name: t.name } }]));
    choicesList.forEach(([label, toolChoice], k) => {
      items.push({
        suite: 'tools', key: `tools/${label}`, name: `tool_choice ${label}`, tool: true,
        body: { tools, tool_choice: toolChoice },
        prompt: d.tools.prompts[k % d.tools.prompts.length],
        satisfiable: true,
        checkTools: (msg) => {
          const calls = msg.tool_calls;
          if (!Array.isArray(calls) || calls.length === 0) return { ok: false, error: 'no tool_calls' };
          for (const call of calls) {
            const fn = call.function || {};
            if (label !== 'required' && fn.name !== label) return { ok: false, error: `called ${fn.name}, not ${label}` };
            if (!validators[fn.name]) return { ok: false, error: `unknown tool ${fn.name}` };
            const r = jsonCheck(fn.arguments, validators[fn.name], ajv);
            if (!r.ok) return { ok: false, error: `${fn.name} arguments: ${r.error}` };
          }
          return { ok: true };
        },
      });
    });
  }
  return items;
}

function jsonCheck(text, validate, ajv) {
  if (typeof text !== 'string') return { ok: false, error: `no text (${text})` };
  const strict = checkJsonDocument(text);
  if (!strict.ok) return strict;
  const value = JSON.parse(text);
  if (!validate(value)) return { ok: false, error: `ajv: ${ajv.errorsText(validate.errors)}` };
  return { ok: true };
}

// Modes: greedy|sampled - alone|batched|streamed|n2. "streamed" sends
// stream: true (all at once; the text and tool calls put together from the
// chunks by the client library), "n2" asks for two choices per request.
// Returns one result per choice.
async function send(client, opts, model, item, mode, seed) {
  const sampled = mode.startsWith('sampled');
  const n = mode.endsWith('-n2') ? 2 : 1;
  const common = {
    model, max_tokens: opts.maxTokens, temperature: sampled ? 1.0 : 0,
    ...(sampled ? { seed, top_p: 1 } : {}), ...(n > 1 ? { n } : {}), ...item.body,
  };
  const streamed = mode.endsWith('-streamed');
  if (opts.api === 'chat') {
    const body = { ...common, messages: [{ role: 'user', content: item.prompt }] };
    const r = streamed ? await client.chat.completions.stream(body).finalChatCompletion()
      : await client.chat.completions.create(body);
    return r.choices.map((c) => ({
      text: c.message.content, message: c.message, finish: c.finish_reason, tokens: r.usage && r.usage.completion_tokens,
    }));
  }
  const body = { ...common, prompt: 'Once upon a time' };
  if (streamed) {
    const texts = [], finishes = [];
    for await (const chunk of await client.completions.create({ ...body, stream: true })) {
      for (const c of chunk.choices) {
        texts[c.index] = (texts[c.index] || '') + (c.text || '');
        if (c.finish_reason) finishes[c.index] = c.finish_reason;
      }
    }
    return texts.map((text, k) => ({ text, finish: finishes[k] }));
  }
  const r = await client.completions.create(body);
  return r.choices.map((c) => ({ text: c.text, finish: c.finish_reason, tokens: r.usage && r.usage.completion_tokens }));
}

function classify(item, res) {
  if (item.tool) {
    if (res.finish === 'length') return { outcome: 'length' };
    if (res.finish !== 'tool_calls' && res.finish !== 'stop') return { outcome: 'invalid', error: `finish_reason ${res.finish}` };
    const r = item.checkTools(res.message);
    return r.ok ? { outcome: 'complete' } : { outcome: 'invalid', error: r.error };
  }
  if (typeof res.text !== 'string') return { outcome: 'invalid', error: `no text (finish ${res.finish})` };
  if (res.finish === 'length') {
    if (!item.prefix) return { outcome: 'length' };
    const r = item.prefix(res.text);
    return r.ok ? { outcome: 'length' } : { outcome: 'invalid', error: `cut output is no prefix: ${r.error}` };
  }
  if (res.finish !== 'stop') return { outcome: 'invalid', error: `finish_reason ${res.finish}` };
  const r = item.full(res.text);
  return r.ok ? { outcome: 'complete' } : { outcome: 'invalid', error: r.error };
}

// The known issue (known_issues.json) an error matches, if any: the model's
// label, the item's key and a part of the message all match.
function knownIssue(opts, item, message) {
  for (const issue of opts.knownIssues || []) {
    const modelOk = issue.models === '*' || issue.models.includes(opts.label);
    const itemOk = issue.items === '*' || issue.items.includes(item.key);
    if (modelOk && itemOk && message.includes(issue.message)) return issue;
  }
  return null;
}

// Alone modes may run a subset (every M-th item from an offset; greedy and
// sampled take different ones) to bound the sequential time.
function inMode(opts, mode, k) {
  if (!mode.endsWith('alone') || opts.aloneEvery <= 1) return true;
  const shift = mode.startsWith('sampled') ? Math.floor(opts.aloneEvery / 2) : 0;
  return (k + opts.aloneOffset + shift) % opts.aloneEvery === 0;
}

async function runMode(client, opts, model, items, mode, logStream) {
  const one = async (item, k) => {
    const started = Date.now();
    let results;
    try {
      results = (await send(client, opts, model, item, mode, 1000 + k)).map((res) => {
        let cls = classify(item, res);
        const issue = cls.outcome === 'invalid' && knownIssue(opts, item, cls.error);
        if (issue) cls = { outcome: 'known', issue: issue.id, error: cls.error };
        return [res, cls];
      });
      if (!results.length) results = [[{}, { outcome: 'invalid', error: 'no choices' }]];
    } catch (e) {
      let res, cls;
      const status = e && e.status;
      const message = (e && e.message) || String(e);
      res = { error: message, status };
      const issue = knownIssue(opts, item, message);
      // A vocabulary that cannot write the constraint's strings may refuse
      // it; a known issue is reported (where the request should succeed);
      // anything else answered with an error is a failure.
      cls = !item.satisfiable ? { outcome: 'refused', error: `${status}: ${message}` }
        : issue ? { outcome: 'known', issue: issue.id, error: `${status}: ${message}` }
          : { outcome: 'invalid', error: `error although the vocabulary can write a sample: ${status}: ${message}` };
      results = [[res, cls]];
    }
    return results.map(([res, cls], c) => {
      const rec = { k, key: c ? `${item.key}#${c}` : item.key, label: opts.label, tp: opts.tp, mode, suite: item.suite,
        name: item.name, ...cls, finish: res.finish, tokens: res.tokens, ms: Date.now() - started, text: res.text,
        tool_calls: res.message && res.message.tool_calls };
      if (logStream) logStream.write(JSON.stringify(rec) + '\n');
      return rec;
    });
  };
  const chosen = items.map((item, k) => [item, k]).filter(([, k]) => inMode(opts, mode, k));
  if (!mode.endsWith('alone')) return (await Promise.all(chosen.map(([item, k]) => one(item, k)))).flat();
  const out = [];
  for (const [item, k] of chosen) out.push(...await one(item, k));
  return out;
}

// What a request produced, for comparisons (null when it produced nothing).
function outputOf(r) {
  if (r.outcome !== 'complete' && r.outcome !== 'length' && r.outcome !== 'invalid') return null;
  return JSON.stringify([r.text === undefined ? null : r.text, r.tool_calls ? r.tool_calls.map((c) => c.function) : null]);
}

async function runErrors(client, opts, model) {
  const OpenAI = require('openai');
  const failures = [];
  let n = 0;
  const create = (extra) => (opts.api === 'chat'
    ? client.chat.completions.create({ model, max_tokens: 8, messages: [{ role: 'user', content: 'x' }], ...extra })
    : client.completions.create({ model, max_tokens: 8, prompt: 'Once upon a time', ...extra }));
  const cases = [
    ['unsupported keyword patternProperties', { response_format: { type: 'json_schema', json_schema: { name: 'p', strict: true,
      schema: { type: 'object', patternProperties: { '^x': { type: 'string' } } } } } }, 'patternProperties'],
    ['unsupported keyword format', { guided_json: { type: 'string', format: 'hostname-idn' } }, 'format'],
    ['unsupported keyword not', { guided_json: { not: { type: 'null' } } }, 'not'],
    ['unsupported keyword uniqueItems', { guided_json: { type: 'array', items: { type: 'integer' }, uniqueItems: true } }, 'uniqueItems'],
    ['nested unsupported keyword', { guided_json: { type: 'object', properties: { a: { type: 'string', contentEncoding: 'base64' } } } }, 'contentEncoding'],
    ['two constraints (response_format + guided_regex)', { response_format: { type: 'json_object' }, guided_regex: 'a+' }, null],
    ['two constraints (guided_choice + guided_grammar)', { guided_choice: ['a'], guided_grammar: 'root ::= "a"' }, null],
    ['malformed regex', { guided_regex: '(a' }, null],
    ['backreference', { guided_regex: '(a)\\1' }, null],
    ['grammar without root', { guided_grammar: 'expr ::= "a"' }, 'root'],
    ['left-recursive grammar', { guided_grammar: 'root ::= root "a" | "a"' }, null],
    ['undefined $ref', { guided_json: { $ref: '#/$defs/missing' } }, null],
    // No document satisfies it: a required property that additionalProperties
    // false forbids.
    ['unsatisfiable schema (required b, only a allowed)', { guided_json: { type: 'object',
      properties: { a: { type: 'integer', minimum: 0, maximum: 9 } }, required: ['a', 'b'], additionalProperties: false } }, null],
  ];
  if (opts.api === 'chat') {
    cases.push(['a forced tool call and a response_format', { response_format: { type: 'json_object' },
      tools: [{ type: 'function', function: { name: 'f', parameters: { type: 'object' } } }], tool_choice: 'required' }, null]);
  }
  const known = [];
  for (const [what, extra, keyword] of cases) {
    n++;
    let failure = null;
    try {
      const r = await create(extra);
      failure = `expected HTTP 400, got an answer (${JSON.stringify(r.choices[0]).slice(0, 200)})`;
    } catch (e) {
      if (!(e instanceof OpenAI.BadRequestError)) failure = `expected 400, got ${e.status}: ${e.message}`;
      else if (keyword && !e.message.includes(keyword)) failure = `the 400 does not name ${keyword}: ${e.message}`;
    }
    if (!failure) continue;
    const issue = knownIssue(opts, { key: `errors/${what}` }, failure);
    if (issue) known.push({ issue: issue.id, key: `errors/${what}`, error: failure });
    else failures.push(`${what}: ${failure}`);
  }
  return { n, failures, known };
}

function pad(s, w) { s = String(s); return s.length >= w ? s : s + ' '.repeat(w - s.length); }

async function run(argv) {
  const opts = parseArgs(argv);
  const OpenAI = require('openai');
  const ajv = newAjv();
  const d = loadData(opts.data);
  const client = new OpenAI({ baseURL: opts.base, apiKey: opts.token, maxRetries: 0, timeout: 300000 });
  const models = await client.models.list();
  const model = models.data[0].id;
  const items = buildItems(d, opts, ajv);
  const logStream = opts.log ? fs.createWriteStream(opts.log, { flags: 'a' }) : null;
  const failures = [];
  const rows = [];
  const known = new Map();  // issue id -> occurrences
  const outputs = {};  // mode -> item key -> output
  let lastCut = new Set();  // keys cut by max_tokens in greedy-batched
  for (const mode of opts.modes) {
    const t0 = Date.now();
    const recs = await runMode(client, opts, model, items, mode, logStream);
    outputs[mode] = Object.fromEntries(recs.map((r) => [r.key, outputOf(r)]));
    if (mode === 'greedy-batched') lastCut = new Set(recs.filter((r) => r.outcome === 'length').map((r) => r.key));
    const suites = [...new Set(items.map((i) => i.suite))];
    for (const suite of suites) {
      const rs = recs.filter((r) => r.suite === suite);
      if (!rs.length) continue;
      const count = (o) => rs.filter((r) => r.outcome === o).length;
      rows.push([suite, opts.label, opts.tp, mode, rs.length, count('complete'), count('length'), count('refused'),
        count('known'), count('invalid')]);
    }
    for (const r of recs) {
      if (r.outcome === 'invalid') {
        failures.push(`${opts.label} TP ${opts.tp} ${mode} ${r.suite} ${r.name}: ${r.error}; output ${JSON.stringify(r.text)}` +
          (r.tool_calls ? ` tool_calls ${JSON.stringify(r.tool_calls)}` : '') + ` (finish ${r.finish})`);
      }
      if (r.outcome === 'known') {
        if (!known.has(r.issue)) known.set(r.issue, []);
        known.get(r.issue).push(`${mode} ${r.key}`);
      }
    }
    const answered = recs.filter((r) => r.outcome === 'complete' || r.outcome === 'length');
    const complete = answered.filter((r) => r.outcome === 'complete').length;
    if (answered.length && complete < opts.minComplete * answered.length) {
      failures.push(`${opts.label} TP ${opts.tp} ${mode}: only ${complete} of ${answered.length} answered requests complete ` +
        `within max_tokens ${opts.maxTokens} (< ${opts.minComplete})`);
    }
    console.log(`${opts.label} TP ${opts.tp} ${mode}: ${recs.length} requests in ${((Date.now() - t0) / 1000).toFixed(1)} s`);
  }
  // Greedy outputs cut by max_tokens, continued further: the cut one is a prefix.
  if (opts.extendCut && outputs['greedy-batched']) {
    const cut = new Set(Object.entries(outputs['greedy-batched']).filter(([, t]) => t !== null)
      .map(([key]) => key).filter((key) => lastCut.has(key)));
    const again = items.filter((item) => cut.has(item.key));
    const t0 = Date.now();
    const recs = await runMode(client, { ...opts, maxTokens: opts.extendCut }, model, again, 'greedy-extended', logStream);
    let prefixes = 0;
    for (const r of recs) {
      const [short] = JSON.parse(outputs['greedy-batched'][r.key]);
      if (typeof r.text === 'string' && typeof short === 'string' && r.text.startsWith(short)) prefixes++;
      else if (!r.tool_calls) failures.push(`${opts.label} TP ${opts.tp} greedy-extended ${r.key}: the output cut at ${opts.maxTokens} tokens ${JSON.stringify(short)} is no prefix of ${JSON.stringify(r.text)}`);
      if (r.outcome === 'invalid') {
        failures.push(`${opts.label} TP ${opts.tp} greedy-extended ${r.suite} ${r.name}: ${r.error}; output ${JSON.stringify(r.text)} (finish ${r.finish})`);
      }
    }
    for (const suite of [...new Set(recs.map((r) => r.suite))]) {
      const rs = recs.filter((r) => r.suite === suite);
      const count = (o) => rs.filter((r) => r.outcome === o).length;
      rows.push([suite, opts.label, opts.tp, 'greedy-extended', rs.length, count('complete'), count('length'), count('refused'),
        count('known'), count('invalid')]);
    }
    console.log(`${opts.label} TP ${opts.tp} greedy-extended: ${recs.length} cut outputs continued to ${opts.extendCut} tokens ` +
      `in ${((Date.now() - t0) / 1000).toFixed(1)} s: ${recs.filter((r) => r.outcome === 'complete').length} complete now, ` +
      `${prefixes} extend the cut output`);
  }
  // Batching must not change a token: alone == batched, greedy and seeded.
  const compare = (a, b, what) => {
    let same = 0, both = 0;
    for (const [key, t] of Object.entries(a)) {
      if (!(key in b) || t === null || b[key] === null) continue;
      both++;
      if (t === b[key]) same++;
      else failures.push(`${opts.label} TP ${opts.tp} ${what}: ${key}: ${t} != ${b[key]}`);
    }
    console.log(`${opts.label} TP ${opts.tp} ${what}: equal for ${same} of ${both}`);
  };
  for (const kind of ['greedy', 'sampled']) {
    const b = outputs[`${kind}-batched`];
    if (!b) continue;
    for (const other of ['alone', 'streamed']) {
      const a = outputs[`${kind}-${other}`];
      if (a) compare(a, b, `${kind} ${other} == batched`);
    }
  }
  if (opts.outputs) fs.writeFileSync(opts.outputs, JSON.stringify(outputs));
  if (opts.expect) {
    // Another server's outputs (e.g. without speculative decoding): the same per mode.
    const want = JSON.parse(fs.readFileSync(opts.expect, 'utf8'));
    for (const mode of opts.modes) if (want[mode]) compare(outputs[mode], want[mode], `${mode} == ${path.basename(opts.expect)}`);
  }
  if (opts.errors) {
    const e = await runErrors(client, opts, model);
    failures.push(...e.failures);
    for (const k of e.known) {
      if (!known.has(k.issue)) known.set(k.issue, []);
      known.get(k.issue).push(k.key);
      if (logStream) logStream.write(JSON.stringify({ label: opts.label, tp: opts.tp, mode: '-', suite: 'errors', outcome: 'known', ...k }) + '\n');
    }
    rows.push(['errors(400)', opts.label, opts.tp, '-', e.n, e.n - e.failures.length - e.known.length, 0, 0,
      e.known.length, e.failures.length]);
  }
  if (logStream) await new Promise((r) => logStream.end(r));
  const header = ['suite', 'model', 'TP', 'mode', 'requests', 'complete', 'length-cut', 'refused', 'known', 'invalid'];
  const widths = [12, 12, 3, 16, 9, 9, 11, 8, 6, 8];
  console.log(header.map((h, k) => pad(h, widths[k])).join(' '));
  for (const r of rows) console.log(r.map((c, k) => pad(c, widths[k])).join(' '));
  if (opts.summary) fs.appendFileSync(opts.summary, rows.map((r) => r.join('\t')).join('\n') + '\n');
  const refused = rows.reduce((s, r) => s + Number(r[7]), 0);
  if (refused) console.log(`${opts.label} TP ${opts.tp}: ${refused} requests refused (the vocabulary cannot write a sample of theirs)`);
  for (const [id, where] of known) {
    console.log(`KNOWN ISSUE ${id} (known_issues.json): ${where.length} requests: ${where.slice(0, 6).join(', ')}${where.length > 6 ? ', ...' : ''}`);
  }
  if (failures.length) {
    for (const f of failures.slice(0, 60)) console.error('FAIL:', f);
    if (failures.length > 60) console.error(`... and ${failures.length - 60} more`);
    process.exit(1);
  }
}

// One output from elsewhere (e.g. `exl3serve client` over gRPC):
//   check --data DIR --item KEY --finish F --text FILE [--expect OUTPUTS --mode MODE]
// F: the gRPC finish reason (constraint_complete, eos, length, ...). With
// --expect, the text must equal that mode's output of the item there.
function check(argv) {
  const o = { api: 'completions', suites: 'schemas,regex,grammar,choice,json_object', mode: 'greedy-batched' };
  for (let k = 0; k < argv.length; k++) {
    const v = () => argv[++k];
    switch (argv[k]) {
      case '--data': o.data = v(); break;
      case '--item': o.item = v(); break;
      case '--finish': o.finish = v(); break;
      case '--text': o.text = fs.readFileSync(v(), 'utf8'); break;
      case '--expect': o.expect = v(); break;
      case '--mode': o.mode = v(); break;
      default: throw new Error(`unknown argument ${argv[k]}`);
    }
  }
  o.suites = o.suites.split(',');
  const item = buildItems(loadData(o.data), o, newAjv()).find((i) => i.key === o.item);
  if (!item) throw new Error(`no item ${o.item}`);
  const finish = { constraint_complete: 'stop', eos: 'stop', length: 'length' }[o.finish] || o.finish;
  const cls = classify(item, { text: o.text, finish });
  let ok = cls.outcome === 'complete' || cls.outcome === 'length';
  let note = '';
  if (o.expect) {
    const want = (JSON.parse(fs.readFileSync(o.expect, 'utf8'))[o.mode] || {})[o.item];
    if (want === undefined) throw new Error(`no ${o.mode} output of ${o.item} in ${o.expect}`);
    const same = want === JSON.stringify([o.text, null]);
    note = same ? `, = ${o.mode} over HTTP` : `, != ${o.mode} over HTTP ${want}`;
    ok = ok && same;
  }
  console.log(`${o.item}: ${cls.outcome} (finish ${o.finish})${cls.error ? ': ' + cls.error : ''}${note}: ${JSON.stringify(o.text)}`);
  if (!ok) process.exit(1);
}

module.exports = { parseStrictJson, checkJsonDocument, checkJsonPrefix, arithmeticFull, arithmeticScan, balancedFull, balancedPrefix };

if (require.main === module) {
  const [cmd, ...rest] = process.argv.slice(2);
  if (cmd === 'selftest') selftest(rest[0]);
  else if (cmd === 'check') check(rest);
  else if (cmd === 'run') run(rest).catch((e) => { console.error('FAIL:', e.stack || e); process.exit(1); });
  else { console.error('usage: validate.cjs selftest DIR | run --base URL --data DIR --label L --tp N ...'); process.exit(2); }
}
