// Hugging Face's side of the tokenizer reference test (run_reference.sh), run
// with Debian's nodejs on the packages in $DTP_NPM_PREFIX (the npm cache folder):
//   encode TOKENIZER_JSON CORPUS OUT   `tokenizers` (HF's Rust library for
//       Node): each NUL-separated record of CORPUS, decoded from bytes as Node
//       does (U+FFFD for ill-formed subparts), encoded with add_special_tokens
//       and decoded with skip_special_tokens true and false -> {"ids", "text",
//       "all"} per line.
//       Prints tokens/s of the Rust library on RAYON_NUM_THREADS threads.
//   bench-js TOKENIZER_DIR CORPUS      @huggingface/transformers (HF's
//       JavaScript port): tokens/s on the same records, one thread.
//   chat FOLDER CASES OUT              @huggingface/transformers'
//       apply_chat_template of a case's "messages" (a conversation) or of its
//       system and user (tokenize=false, add_generation_prompt=true, and a
//       case's enable_thinking and date_string) with its Jinja engine (which
//       defines strftime_now, local time, as Python transformers does), then the Rust library's ids of that text (no added
//       special tokens, as apply_chat_template encodes) and their decode
//       (skip_special_tokens=false) -> {"text", "ids", "decoded"} or {"error"}
//       per case.
//   compare REFERENCE DTP LABEL [roundtrip]   line by line; prints the counts
//       and the first differences; exits 1 on any difference, or, with
//       roundtrip, on a chat line whose "decoded" is not its "text".
import fs from 'fs';
import { createRequire } from 'module';
import path from 'path';
import { pathToFileURL } from 'url';

// The packages live in the npm cache folder that run_reference.sh names.
const prefix = process.env.DTP_NPM_PREFIX;
if (!prefix) throw new Error('reference.mjs: set DTP_NPM_PREFIX to the npm folder (run_reference.sh does)');
const require = createRequire(path.join(prefix, 'package.json'));
const transformers = async () => import(pathToFileURL(require.resolve('@huggingface/transformers')).href);
const [mode, ...args] = process.argv.slice(2);

function records(corpus) {
  const buf = fs.readFileSync(corpus);
  const out = [];
  let at = 0;
  for (let i = 0; i < buf.length; i++) {
    if (buf[i] === 0) {
      out.push(buf.subarray(at, i).toString('utf8'));
      at = i + 1;
    }
  }
  if (at < buf.length) out.push(buf.subarray(at).toString('utf8'));
  return out;
}

const seconds = (t0) => Number(process.hrtime.bigint() - t0) / 1e9;

async function encode(tokenizerJson, corpus, outPath) {
  const { Tokenizer } = require('tokenizers');
  const tok = Tokenizer.fromFile(tokenizerJson);
  const texts = records(corpus);
  await tok.encodeBatch(texts.slice(0, 100), { addSpecialTokens: true });  // warm up
  const t0 = process.hrtime.bigint();
  const encodings = await tok.encodeBatch(texts, { addSpecialTokens: true });
  const s = seconds(t0);
  const ids = encodings.map((e) => e.getIds());
  const decoded = await tok.decodeBatch(ids, true);
  const all = await tok.decodeBatch(ids, false);
  const tokens = ids.reduce((n, v) => n + v.length, 0);
  fs.writeFileSync(outPath, ids.map((v, i) => JSON.stringify({ ids: v, text: decoded[i], all: all[i] })).join('\n') +
                   '\n');
  const threads = process.env.RAYON_NUM_THREADS || 'all';
  console.error(`tokenizers (Rust, npm): ${texts.length} records, ${tokens} tokens, encode ${s.toFixed(3)} s, ` +
                `${Math.round(tokens / s)} tokens/s (${threads} threads)`);
}

async function benchJs(dir, corpus) {
  const { PreTrainedTokenizer } = await transformers();
  const tok = new PreTrainedTokenizer(JSON.parse(fs.readFileSync(`${dir}/tokenizer.json`, 'utf8')),
                                      JSON.parse(fs.readFileSync(`${dir}/tokenizer_config.json`, 'utf8')));
  const texts = records(corpus);
  for (const t of texts.slice(0, 100)) tok.encode(t);
  const t0 = process.hrtime.bigint();
  let tokens = 0;
  for (const t of texts) tokens += tok.encode(t).length;
  const s = seconds(t0);
  console.error(`@huggingface/transformers (JS): ${texts.length} records, ${tokens} tokens, encode ${s.toFixed(3)} s, ` +
                `${Math.round(tokens / s)} tokens/s (1 thread)`);
}

async function chat(folder, casesPath, outPath) {
  const { PreTrainedTokenizer } = await transformers();
  const { Tokenizer } = require('tokenizers');
  const config = JSON.parse(fs.readFileSync(`${folder}/tokenizer_config.json`, 'utf8'));
  const js = new PreTrainedTokenizer(JSON.parse(fs.readFileSync(`${folder}/tokenizer.json`, 'utf8')), config);
  const rust = Tokenizer.fromFile(`${folder}/tokenizer.json`);
  const lines = [];
  for (const c of JSON.parse(fs.readFileSync(casesPath, 'utf8'))) {
    // A case is a conversation ("messages") or one [system] + user turn.
    const messages = c.messages ? c.messages.map((m) => ({ ...m })) : [];
    if (!c.messages) {
      if (c.system !== null && c.system !== undefined) messages.push({ role: 'system', content: c.system });
      messages.push({ role: 'user', content: c.user });
    }
    const options = { tokenize: false, add_generation_prompt: true };
    if (c.enable_thinking !== undefined) options.enable_thinking = c.enable_thinking;
    if (c.date_string !== undefined) options.date_string = c.date_string;
    try {
      const text = js.apply_chat_template(messages, options);
      const ids = (await rust.encode(text, null, { addSpecialTokens: false })).getIds();
      lines.push(JSON.stringify({ text, ids, decoded: await rust.decode(ids, false) }));
    } catch (e) {
      lines.push(JSON.stringify({ error: String(e.message || e) }));
    }
  }
  fs.writeFileSync(outPath, lines.join('\n') + '\n');
}

function compare(refPath, dtpPath, label, roundtrip) {
  const ref = fs.readFileSync(refPath, 'utf8').split('\n').filter((l) => l.length);
  const dtp = fs.readFileSync(dtpPath, 'utf8').split('\n').filter((l) => l.length);
  let idDiffs = 0, textDiffs = 0, errorDiffs = 0, bothErrors = 0, tokens = 0;
  const shown = [];
  const show = (i, what) => { if (shown.length < 5) shown.push(`  record ${i}: ${what}`); };
  if (ref.length !== dtp.length) {
    console.log(`${label}: FAIL: ${ref.length} reference lines, ${dtp.length} dtp lines`);
    process.exit(1);
  }
  for (let i = 0; i < ref.length; ++i) {
    const r = JSON.parse(ref[i]), d = JSON.parse(dtp[i]);
    if ('error' in r || 'error' in d) {
      if (!('error' in r && 'error' in d)) {
        ++errorDiffs;
        show(i, `reference ${JSON.stringify(r).slice(0, 300)}\n    dtp ${JSON.stringify(d).slice(0, 300)}`);
      } else {
        ++bothErrors;
      }
      continue;
    }
    tokens += r.ids.length;
    if (JSON.stringify(r.ids) !== JSON.stringify(d.ids)) {
      ++idDiffs;
      let k = 0;
      while (k < r.ids.length && r.ids[k] === d.ids[k]) ++k;
      show(i, `ids differ at ${k}: reference [${r.ids.slice(k, k + 8)}] dtp [${d.ids.slice(k, k + 8)}]; ` +
              `text ${JSON.stringify(r.text).slice(0, 200)}`);
    }
    if (roundtrip === 'roundtrip' && d.decoded !== d.text) {
      ++textDiffs;
      show(i, `decoded is not the prompt: ${JSON.stringify(d.decoded).slice(0, 200)}`);
    }
    // text: skip_special_tokens=true; all, decoded: false.
    for (const key of ['text', 'all', 'decoded']) {
      if (r[key] === d[key]) continue;
      ++textDiffs;
      show(i, `${key} differs: reference ${JSON.stringify(r[key]).slice(0, 200)}\n    dtp ` +
              `${JSON.stringify(d[key]).slice(0, 200)}`);
    }
  }
  const ok = idDiffs + textDiffs + errorDiffs === 0;
  console.log(`${label}: ${ok ? 'ok' : 'FAIL'}: ${ref.length} records, ${tokens} tokens; ` +
              `${idDiffs} differ in ids, ${textDiffs} in text, ${errorDiffs} in errors` +
              (bothErrors ? ` (${bothErrors} refused by both)` : ''));
  for (const s of shown) console.log(s);
  if (!ok) process.exit(1);
}

if (mode === 'encode') await encode(...args);
else if (mode === 'bench-js') await benchJs(...args);
else if (mode === 'chat') await chat(...args);
else if (mode === 'compare') compare(...args);
else {
  console.error(`reference.mjs: unknown mode '${mode}'`);
  process.exit(2);
}
