// Prefix caching under load (see prefix_cache_bench.sh, which runs it
// against one server with --enable-prefix-caching and one without):
//   node prefix_cache_bench.mjs run BASE_URL REQUESTS CLIENTS OUT.json
//   node prefix_cache_bench.mjs compare OFF.json ON.json
// `run`: CLIENTS concurrent clients send REQUESTS streamed completions
// (even ones greedy, odd ones seeded), each a 400-character system prompt
// (400 tokens of the byte tokenizer) and a distinct 15-character suffix, 16
// tokens out; records each
// one's time to first token (send to the first chunk with a choice) and
// text, and the deltas of /metrics' prompt tokens and prefix cache
// queries/hits over the run. `compare`: the side-by-side table; exits 1
// (FAILED) when a request's text differs between the two runs.
import { createRequire } from 'node:module';
import fs from 'node:fs';
import path from 'node:path';

const [mode, ...args] = process.argv.slice(2);

const pct = (xs, q) => {
  const s = [...xs].sort((a, b) => a - b);
  return s.length ? s[Math.min(s.length - 1, Math.floor(q * (s.length - 1) + 0.5))] : NaN;
};

// 400 characters: the same for every request, in every run.
function systemPrompt() {
  const words = ['the', 'engine', 'keeps', 'full', 'blocks', 'of', 'keys', 'and', 'values', 'for', 'prompts',
                 'that', 'start', 'alike', 'so', 'later', 'requests', 'skip', 'their', 'prefill'];
  let s = 'System: you are a terse assistant. ';
  for (let i = 0; s.length < 400; i++) s += words[(i * 7) % words.length] + ' ';
  return s.slice(0, 400);
}
const suffix = (i) => `\nQuestion ${String(i).padStart(4, '0')}:`;  // 15 characters, distinct

async function metrics(baseURL) {
  const text = await (await fetch(baseURL.replace(/\/v1\/?$/, '') + '/metrics')).text();
  const m = {};
  for (const line of text.split('\n')) {
    const [name, value] = line.split(' ');
    if (name && !name.startsWith('#') && value !== undefined) m[name] = Number(value);
  }
  for (const k of ['dtp_serve_prompt_tokens_total', 'dtp_serve_prefix_cache_queries_total',
                   'dtp_serve_prefix_cache_hits_total', 'dtp_serve_preemptions_total']) {
    if (!(k in m)) throw new Error(`prefix_cache_bench: /metrics has no ${k}`);
  }
  return m;
}

async function run(baseURL, requests, clients, out) {
  const require = createRequire(path.join(process.env.DTP_NPM_PREFIX, 'node_modules', 'x.js'));
  const OpenAI = require('openai');
  const client = new OpenAI({ baseURL, apiKey: 'none', maxRetries: 0 });
  const model = (await client.models.list()).data[0].id;
  const system = systemPrompt();
  if (system.length !== 400) throw new Error(`prefix_cache_bench: system prompt of ${system.length} characters`);
  const before = await metrics(baseURL);
  const results = new Array(requests);
  let next = 0;
  const t0 = performance.now();
  await Promise.all(Array.from({ length: clients }, async () => {
    for (let i = next++; i < requests; i = next++) {
      const start = performance.now();
      // Even requests greedy, odd ones seeded (their own seed: the same draws
      // on both servers).
      const sampling = i % 2 === 0 ? { temperature: 0 } : { temperature: 1.0, seed: 1000 + i };
      const stream = await client.completions.create({ model, prompt: system + suffix(i), max_tokens: 16, ...sampling,
                                                       stream: true, stream_options: { include_usage: true } });
      let ttft = null, text = '', usage = null, finish = null;
      for await (const c of stream) {
        if (c.usage) usage = c.usage;
        if (!c.choices.length) continue;
        if (ttft === null) ttft = performance.now() - start;
        text += c.choices[0].text ?? '';
        finish = c.choices[0].finish_reason ?? finish;
      }
      results[i] = { ttft, text, prompt_tokens: usage?.prompt_tokens, completion_tokens: usage?.completion_tokens,
                     finish };
    }
  }));
  const seconds = (performance.now() - t0) / 1000;
  const after = await metrics(baseURL);
  const delta = (k) => after[k] - before[k];
  const summary = {
    baseURL, requests, clients, seconds,
    prompt_tokens: delta('dtp_serve_prompt_tokens_total'),
    queries: delta('dtp_serve_prefix_cache_queries_total'),
    hits: delta('dtp_serve_prefix_cache_hits_total'),
    preemptions: delta('dtp_serve_preemptions_total'),
    results,
  };
  fs.writeFileSync(out, JSON.stringify(summary));
  const ttfts = results.map((r) => r.ttft);
  console.log(`prefix_cache_bench: ${baseURL}: ${requests} requests in ${seconds.toFixed(2)} s, TTFT p50 ` +
              `${pct(ttfts, 0.5).toFixed(1)} ms p99 ${pct(ttfts, 0.99).toFixed(1)} ms, prompt tokens ` +
              `${summary.prompt_tokens}, prefix cache queries ${summary.queries} hits ${summary.hits}`);
}

function compare(offPath, onPath) {
  const off = JSON.parse(fs.readFileSync(offPath)), on = JSON.parse(fs.readFileSync(onPath));
  const differ = [];
  for (let i = 0; i < off.requests; i++) {
    const a = off.results[i], b = on.results[i];
    if (!a || !b || a.text !== b.text || a.completion_tokens !== b.completion_tokens) differ.push(i);
  }
  // Without caching every prompt token is computed (the server counts no
  // queries then); with it, those not found in the cache.
  const computed = (r) => (r.queries > 0 ? r.queries - r.hits : r.prompt_tokens);
  const row = (name, r) => {
    const t = r.results.map((x) => x.ttft);
    return `| ${name.padEnd(10)} | ${pct(t, 0.5).toFixed(1).padStart(8)} | ${pct(t, 0.99).toFixed(1).padStart(8)} | ` +
           `${String(r.prompt_tokens).padStart(13)} | ${String(r.queries).padStart(7)} | ${String(r.hits).padStart(6)} | ` +
           `${String(computed(r)).padStart(15)} | ${String(r.preemptions).padStart(11)} | ${r.seconds.toFixed(2).padStart(6)} |`;
  };
  console.log(`prefix_cache_bench: ${off.requests} requests, ${off.clients} clients, 400-character shared prompt`);
  console.log('| caching    | TTFT p50 | TTFT p99 | prompt tokens | queries |   hits | tokens computed | preemptions | wall s |');
  console.log('|------------|---------:|---------:|--------------:|--------:|-------:|----------------:|------------:|-------:|');
  console.log(row('off', off));
  console.log(row('on', on));
  const outTokens = (r) => r.results.reduce((a, x) => a + (x?.completion_tokens ?? 0), 0);
  const nonEmpty = off.results.filter((x) => x && x.text.length > 0).length;
  console.log(`prefix_cache_bench: outputs identical: ${differ.length === 0 ? 'yes' : 'NO'} ` +
              `(${off.requests - differ.length} of ${off.requests} requests' texts equal; ${nonEmpty} non-empty; ` +
              `${outTokens(off)} and ${outTokens(on)} completion tokens)`);
  const distinct = new Set(off.results.map((x) => x?.text)).size;
  console.log(`prefix_cache_bench: ${distinct} distinct texts of ${off.requests}`);
  if (off.requests > 1 && distinct < 2) {
    console.log('prefix_cache_bench: FAILED: every request got the same text: equal outputs would prove nothing');
    process.exit(1);
  }
  if (off.hits !== 0 || on.hits <= 0) {
    console.log(`prefix_cache_bench: FAILED: hits ${off.hits} without caching (expected 0), ${on.hits} with (expected > 0)`);
    process.exit(1);
  }
  if (differ.length) {
    const i = differ[0];
    console.log(`prefix_cache_bench: FAILED: ${differ.length} requests differ, the first ${i}: ` +
                `without caching ${JSON.stringify(off.results[i]?.text)}, with ${JSON.stringify(on.results[i]?.text)}`);
    process.exit(1);
  }
}

if (mode === 'run') await run(args[0], Number(args[1]), Number(args[2]), args[3]);
else if (mode === 'compare') compare(args[0], args[1]);
else {
  console.log('usage: prefix_cache_bench.mjs run BASE_URL REQUESTS CLIENTS OUT.json | compare OFF.json ON.json');
  process.exit(2);
}
