// dtp-serve's paged KV cache, preemption, chunked prefill and faults, with
// OpenAI's Node client (see serve_test.sh):
//   node serve_paged_test.mjs BASE_URL DTPRUN GREEDY_REFERENCE WORKDIR RANK1_PID
// BASE_URL serves the byte-vocabulary model with a pool too small for its
// batch (preemption), 5-token prefill chunks and 4-token blocks. Checks:
//  1. 12 concurrent greedy requests (prompts of 2 to 60 tokens, 30 to 80 out)
//     and a seeded sample equal models::generate's tokens / the same request
//     alone, although sequences were preempted and recomputed (counted by
//     /metrics) and long prompts were prefilled in chunks; every KV block is
//     back at the end;
//  2. a client that aborts a stream: its sequence stops (cancelled in
//     /metrics, far fewer tokens than asked) and its blocks return;
//  3. rank 1 killed (SIGKILL) during requests: each gets a 503 naming rank 1,
//     within a bounded wait (the caller then checks that the server exits
//     non-zero).
// Exits 1 naming each failed check.
import { execFileSync } from 'node:child_process';
import { writeFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import path from 'node:path';

import { checker, same } from './checks.mjs';

const [baseURL, dtprun, reference, work, rank1] = process.argv.slice(2);
const require = createRequire(path.join(process.env.DTP_NPM_PREFIX, 'node_modules', 'x.js'));
const OpenAI = require('openai');
const client = new OpenAI({ baseURL, apiKey: 'none', maxRetries: 0, timeout: 120000 });
const metricsURL = baseURL.replace(/\/v1$/, '/metrics');

const { check, failed } = checker('serve_paged_test');
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
async function metrics() {
  const text = await (await fetch(metricsURL)).text();
  const get = (name) => Number(text.match(new RegExp(`^${name} (\\S+)$`, 'm'))[1]);
  return { preemptions: get('dtp_serve_preemptions_total'), cancelled: get('dtp_serve_requests_cancelled_total'),
           used: get('dtp_serve_kv_blocks_used'), total: get('dtp_serve_kv_blocks_total'), running: get('dtp_serve_running'),
           tokens: get('dtp_serve_generation_tokens_total') };
}
// Waits (at most `seconds`) until the server runs nothing; returns the metrics.
async function idle(seconds) {
  let m = await metrics();
  for (let i = 0; i < seconds * 20 && (m.running > 0 || m.used > 0); i++) {
    await sleep(50);
    m = await metrics();
  }
  return m;
}
function referenceTokens(cases, context) {
  const file = path.join(work, 'paged_cases.txt');
  writeFileSync(file, cases.map(([ids, n]) => `${n} - ${ids.join(' ')}`).join('\n') + '\n');
  const out = execFileSync(dtprun, ['-n', '2', reference, path.join(work, 'hf'), String(context), file], { encoding: 'utf8' });
  return out.split('\n').filter((l) => l.includes('reference:')).map((l) => l.split('reference:')[1].trim().split(/\s+/).filter(Boolean).map(Number));
}

const model = (await client.models.list()).data[0].id;
const context = (await client.models.list()).data[0].max_model_len;
const m0 = await metrics();

// 1. Concurrent requests through preemption and chunked prefill.
const words = 'the quick brown fox jumps over the lazy dog and then it rests under a tree ';
const jobs = [];
for (let i = 0; i < 12; i++) {
  const prompt = words.repeat(2).slice(i % 3, i % 3 + 2 + (i * 29) % 59);  // 2..60 bytes
  jobs.push({ prompt, max_tokens: 30 + (i * 17) % 51 });
}
const complete = (j, extra = {}) => client.completions.create({ model, prompt: j.prompt, max_tokens: j.max_tokens, temperature: 0,
                                                                 return_token_ids: true, ...extra });
const seeded = { prompt: 'It is', max_tokens: 60 }, sampling = { temperature: 0.9, top_k: 20, seed: 11 };
const seededAlone = await complete(seeded, sampling);
const together = await Promise.all([...jobs.map((j) => complete(j)), complete(seeded, sampling)]);
const ref = referenceTokens(together.slice(0, 12).map((r, i) => [r.prompt_token_ids, jobs[i].max_tokens]), context);
together.slice(0, 12).forEach((r, i) => {
  check(same(r.choices[0].token_ids, ref[i]),
        `request ${i} (${r.prompt_token_ids.length} prompt tokens, ${jobs[i].max_tokens} out): server ${JSON.stringify(r.choices[0].token_ids)} vs generate ${JSON.stringify(ref[i])}`);
});
check(same(together[12].choices[0].token_ids, seededAlone.choices[0].token_ids),
      `seeded sample in a preempting batch ${JSON.stringify(together[12].choices[0].token_ids)} vs alone ${JSON.stringify(seededAlone.choices[0].token_ids)}`);
const m1 = await idle(10);
check(m1.preemptions > m0.preemptions, `no sequence was preempted (${m1.preemptions} preemptions): the pool of ${m1.total} blocks should be too small for 13 requests`);
check(m1.used === 0 && m1.running === 0, `after the batch: ${m1.used} of ${m1.total} KV blocks still held, ${m1.running} running`);
// The latency histograms: cumulative buckets ending in their count, and one
// observation per token: the first of each request in TTFT, the others in ITL.
{
  const text = await (await fetch(metricsURL)).text();
  const value = (line) => Number(text.match(new RegExp(`^${line.replace(/[{}+"]/g, (c) => '\\' + c)} (\\S+)$`, 'm'))[1]);
  const buckets = (name) => [...text.matchAll(new RegExp(`^${name}_bucket\\{le="([^"]+)"\\} (\\S+)$`, 'gm'))].map((x) => Number(x[2]));
  for (const name of ['dtp_serve_time_to_first_token_seconds', 'dtp_serve_inter_token_latency_seconds']) {
    const b = buckets(name);
    check(b.length === 13 && b.every((x, i) => i === 0 || x >= b[i - 1]) && b[12] === value(`${name}_count`),
          `${name}: buckets ${JSON.stringify(b)}, count ${value(`${name}_count`)}: expected 13 cumulative buckets ending in the count`);
  }
  const ttft = value('dtp_serve_time_to_first_token_seconds_count'), itl = value('dtp_serve_inter_token_latency_seconds_count');
  check(ttft + itl === m1.tokens, `latency histograms: ${ttft} first tokens + ${itl} later tokens, expected ${m1.tokens} tokens in all`);
}
console.log(`serve_paged_test.mjs: 13 concurrent requests equal generate's / alone through ${m1.preemptions - m0.preemptions} preemptions, pool of ${m1.total} blocks`);

// 2. A client that goes away mid-stream.
const abort = new AbortController();
const asked = context - 8;
const stream = await client.completions.create({ model, prompt: 'Once', max_tokens: asked, temperature: 0, stream: true },
                                               { signal: abort.signal });
let pieces = 0;
try {
  for await (const c of stream) {
    if (c.choices.length && c.choices[0].text) pieces++;
    if (pieces >= 2) {
      abort.abort();
      break;  // iterating on after the abort may wait forever (the stream's next() never settles)
    }
  }
} catch (e) {
  check(e.name === 'AbortError' || /abort/i.test(e.message), `the aborted stream failed otherwise: ${e.message}`);
}
const m2 = await idle(20);
check(m2.cancelled === m1.cancelled + 1, `cancelled requests: ${m2.cancelled}, expected ${m1.cancelled + 1} after one aborted stream`);
check(m2.used === 0 && m2.running === 0, `after the aborted stream: ${m2.used} KV blocks held, ${m2.running} running`);
check(m2.tokens - m1.tokens < asked, `the aborted stream's sequence ran on: ${m2.tokens - m1.tokens} tokens of ${asked}`);
console.log(`serve_paged_test.mjs: aborted stream stopped after ${m2.tokens - m1.tokens} of ${asked} tokens, blocks back`);

// 3. Rank 1 dies during requests.
const doomed = [];
for (let i = 0; i < 4; i++) {
  doomed.push(fetch(`${baseURL}/completions`, { method: 'POST', headers: { 'content-type': 'application/json' },
                                                body: JSON.stringify({ model, prompt: 'Never', max_tokens: asked, temperature: 0 }),
                                                signal: AbortSignal.timeout(30000) })
    .then(async (res) => ({ status: res.status, body: await res.text() }), (e) => ({ status: 0, body: String(e) })));
}
for (let i = 0; i < 100 && (await metrics()).running === 0; i++) await sleep(20);
process.kill(Number(rank1), 'SIGKILL');
const answers = await Promise.all(doomed);
answers.forEach((a, i) => {
  check(a.status === 503 && a.body.includes('rank 1'), `request ${i} when rank 1 died: ${a.status} ${a.body.slice(0, 300)}, expected 503 naming rank 1`);
});
console.log(`serve_paged_test.mjs: rank 1 killed: ${answers.map((a) => a.status).join(' ')}: ${answers[0].body.slice(0, 200)}`);

if (failed()) process.exit(1);
console.log('serve_paged_test.mjs: preemption, chunked prefill, aborted stream, dead rank: ok');
