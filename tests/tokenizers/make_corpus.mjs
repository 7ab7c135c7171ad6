// The corpus of the tokenizer reference test: NUL-separated records of bytes
// (a record may hold newlines), deterministic for a given machine's files.
//   node make_corpus.mjs REPO_DIR OUT [FORTUNES_DIR]
// Records: every fortune of Debian's `fortunes` (and each of their lines),
// this repository's source in chunks of 12 lines, then generated records:
// digits, runs of spaces/tabs/newlines, Unicode white space, CJK, emoji (ZWJ
// sequences, flags, skin tones), combining marks (NFC composes them), case
// variants of contractions, added tokens in and around text, and invalid
// UTF-8 (lone continuation bytes, truncated sequences, overlong forms,
// surrogates, F5..FF), and every code point in contexts that show its class
// (letter, number, white space or other: the split patterns' \p{L}, \p{N},
// \s). Prints the count of each kind.
import fs from 'fs';
import path from 'path';

const [repo, out, fortunesDir = '/usr/share/games/fortunes'] = process.argv.slice(2);
const records = [];
const counts = {};
const add = (kind, rec) => {
  const b = Buffer.isBuffer(rec) ? rec : Buffer.from(rec, 'utf8');
  if (b.includes(0)) return;
  records.push(b);
  counts[kind] = (counts[kind] || 0) + 1;
};

// A small deterministic PRNG (mulberry32).
let seed = 0x5eed1234;
const rand = () => {
  seed = (seed + 0x6d2b79f5) | 0;
  let t = Math.imul(seed ^ (seed >>> 15), 1 | seed);
  t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
  return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
};
const pick = (a) => a[Math.floor(rand() * a.length)];
const int = (n) => Math.floor(rand() * n);

// --- fortunes ---
if (fs.existsSync(fortunesDir)) {
  for (const name of fs.readdirSync(fortunesDir).sort()) {
    const file = path.join(fortunesDir, name);
    if (name.endsWith('.dat') || name.endsWith('.u8') || !fs.statSync(file).isFile()) continue;
    const text = fs.readFileSync(file);
    let lineNo = 0;
    for (const fortune of text.toString('latin1').split('\n%\n')) {
      const bytes = Buffer.from(fortune, 'latin1');  // the file's own bytes, UTF-8 or not
      if (bytes.length === 0) continue;
      add('fortune', bytes);
      for (const line of fortune.split('\n')) {
        if (lineNo++ % 4 === 0 && line.length > 0) add('fortune line', Buffer.from(line, 'latin1'));
      }
    }
  }
}

// --- source code ---
const walk = (dir, acc) => {
  for (const e of fs.readdirSync(dir, { withFileTypes: true }).sort((a, b) => a.name.localeCompare(b.name))) {
    const p = path.join(dir, e.name);
    if (e.isDirectory()) walk(p, acc);
    else if (/\.(cpp|h|sh|mjs|py|txt|md|cmake)$/.test(e.name)) acc.push(p);
  }
  return acc;
};
for (const sub of ['src', 'include', 'apps', 'scripts', 'tests']) {
  const dir = path.join(repo, sub);
  if (!fs.existsSync(dir)) continue;
  for (const file of walk(dir, [])) {
    const lines = fs.readFileSync(file, 'utf8').split('\n');
    for (let i = 0; i < lines.length; i += 12) add('source', lines.slice(i, i + 12).join('\n'));
  }
}

// --- generated ---
for (let i = 0; i < 600; ++i) {
  const len = 1 + int(24);
  let d = '';
  for (let k = 0; k < len; ++k) d += String(int(10));
  add('digits', pick(['', ' ', 'x', '$', '+', '-']) + d + pick(['', '.', ' ', 'px', '%', ',' + int(1000), '.' + int(100)]));
}
add('digits', '3.14159265358979323846264338327950288419716939937510');
add('digits', '1,234,567,890 and 0x7fffffff and 1e-12 and 2024-11-27T12:00:00Z');
add('digits', '٠١٢٣٤٥٦٧٨٩ ۰۱۲ ०१२३ 一二三 ① ½ ¾ Ⅻ ²³');

const spaces = [' ', '  ', '\t', '\n', '\r\n', '\n\n', ' \n', '\t\t', '   ', '\r', '\u000b', '\f'];
for (let i = 0; i < 500; ++i) {
  let s = '';
  const parts = 1 + int(8);
  for (let k = 0; k < parts; ++k) {
    s += rand() < 0.5 ? pick(spaces).repeat(1 + int(12)) : pick(['a', 'word', 'Hello', 'x', '.', '!', 'don\'t', '42']);
  }
  add('whitespace', s);
}
add('whitespace', ' '.repeat(5000));
add('whitespace', '\n'.repeat(3000));
add('whitespace', ' \n'.repeat(2000) + 'end');
add('whitespace', 'trailing    ');

const uspaces = ['\u0085', '\u00a0', '\u1680', '\u2000', '\u2003', '\u2009', '\u200a', '\u2028', '\u2029', '\u202f',
                 '\u205f', '\u3000', '\u200b', '\ufeff', '\u180e', '\u001c', '\u001f'];
for (let i = 0; i < 300; ++i) {
  add('unicode space', pick(['a', 'Hello', '1', '']) + pick(uspaces).repeat(1 + int(3)) + pick(['b', 'world', '2', ' ', '']) +
      (rand() < 0.5 ? pick(uspaces) + ' x' : ''));
}

const cjk = ['你好，世界！', '我们今天去公园散步吧。', '東京は日本の首都です。', 'ひらがなとカタカナ、漢字。',
             '한국어 문장입니다.', '大语言模型的分词器', '「引用」と『二重引用』', '中文English混合text',
             '机器学习（ML）是人工智能的一个分支。', 'ｆｕｌｌｗｉｄｔｈ　ＡＢＣ　１２３', '𠀀𠀁𪚥 (CJK Ext B)'];
for (let i = 0; i < 500; ++i) {
  let s = '';
  for (let k = 0, n = 1 + int(4); k < n; ++k) s += pick(cjk) + pick(['', ' ', '\n', ' and ']);
  add('cjk', s);
}

const emoji = ['😀', '👍🏽', '👨‍👩‍👧‍👦', '🏳️‍🌈', '🇫🇷', '🇯🇵', '❤️', '✨', '🤖', '🧑🏿‍💻', '1️⃣', '©', '™', '🫠', '🦀'];
for (let i = 0; i < 500; ++i) {
  let s = '';
  for (let k = 0, n = 1 + int(6); k < n; ++k) s += pick(emoji) + pick(['', ' ', 'ok', '!', '\n']);
  add('emoji', s);
}

const combining = ['e\u0301', 'a\u0300', 'n\u0303', 'o\u0308', 'A\u030a', 'c\u0327', 'Ti\u1ebfng Vi\u1ec7t',
                   'Tie\u0302\u0301ng Vie\u0323\u0302t', '\u1100\u1161\u11a8', '\u0915\u094d\u0937',
                   'z\u0335\u0321\u0317a\u0336l\u0337g\u0338o', '\u0627\u0644\u0639\u0631\u0628\u064a\u0629',
                   '\u05e9\u05c1\u05b8\u05dc\u05d5\u05b9\u05dd', 'Å Ω K (compat)', 'ﬁ ﬂ ﬃ', '\u212b\u2126\u212a'];
for (let i = 0; i < 500; ++i) {
  let s = '';
  for (let k = 0, n = 1 + int(5); k < n; ++k) s += pick(combining) + pick(['', ' ', 'x', '.']);
  add('combining', s);
}

const contractions = ["'s", "'S", "'t", "'T", "'re", "'RE", "'Re", "'ve", "'VE", "'m", "'M", "'ll", "'LL", "'d", "'D",
                      "'\u017f", "'\u212a", '’s'];
for (let i = 0; i < 300; ++i) add('contractions', pick(['it', 'I', 'we', 'THEY', 'x']) + pick(contractions) + pick(['', ' ok', '\n']));

const specials = ['<|begin_of_text|>', '<|end_of_text|>', '<|eot_id|>', '<|start_header_id|>', '<|end_header_id|>',
                  '<|im_start|>', '<|im_end|>', '<|endoftext|>', '<think>', '</think>', '<s>', '</s>', '<unk>',
                  '<|im_st', '<|', '|>', '< s>', '<|reserved_special_token_5|>', '<tool_call>', '<|fim_prefix|>'];
for (let i = 0; i < 600; ++i) {
  let s = '';
  for (let k = 0, n = 1 + int(5); k < n; ++k) s += pick(['', ' ', '  ', '\n', 'x', 'Hello ']) + pick(specials);
  add('added tokens', s + pick(['', ' ', 'end', '\n']));
}

const invalid = [[0x80], [0xbf], [0xc0, 0xaf], [0xc1, 0x81], [0xc3], [0xe2, 0x82], [0xe2], [0xf0, 0x9f, 0x98],
                 [0xed, 0xa0, 0x80], [0xed, 0xbf, 0xbf], [0xf4, 0x90, 0x80, 0x80], [0xf5], [0xf8, 0x88, 0x80, 0x80, 0x80],
                 [0xfe], [0xff], [0xe0, 0x80, 0x80], [0xf0, 0x80, 0x80, 0x80], [0xc3, 0x28], [0xe2, 0x28, 0xa1]];
for (let i = 0; i < 700; ++i) {
  const parts = [];
  for (let k = 0, n = 1 + int(5); k < n; ++k) {
    parts.push(Buffer.from(pick(['', 'a', ' x', 'caf\u00e9', '你', '😀', ' ']), 'utf8'));
    if (rand() < 0.8) parts.push(Buffer.from(pick(invalid)));
    else parts.push(Buffer.from(Array.from({ length: 1 + int(6) }, () => 1 + int(255))));
  }
  add('invalid utf-8', Buffer.concat(parts));
}
add('invalid utf-8', Buffer.from([0xff, 0xfe, 0xfd]));
add('empty', '');

// Every Unicode scalar value (U+0000 NUL aside, the record separator), 256 to
// a record, each between letters, a digit and a space: "x{c}1 {c}x\n" splits
// differently when {c} is a letter, a number, white space or none (NOTE: [The
// reference's Unicode classes] in src/text/hf/regex.cpp; the pieces are in
// tests/tokenizer_unicode_test.cpp's expectedPieces).
for (let first = 1; first < 0x110000; first += 256) {
  let s = '';
  for (let c = first; c < Math.min(first + 256, 0x110000); ++c) {
    if (c >= 0xd800 && c <= 0xdfff) continue;
    const ch = String.fromCodePoint(c);
    s += `x${ch}1 ${ch}x\n`;
  }
  if (s) add('code points', s);
}

fs.writeFileSync(out, Buffer.concat(records.flatMap((r) => [r, Buffer.from([0])])));
console.log(`corpus: ${records.length} records, ${records.reduce((n, r) => n + r.length, 0)} bytes: ` +
            Object.entries(counts).map(([k, v]) => `${k} ${v}`).join(', '));
