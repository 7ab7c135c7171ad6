// A small load test of a running dtp-serve (see serve_test.sh --bench):
//   node serve_bench.mjs BASE_URL CLIENTS REQUESTS_PER_CLIENT [--no-baseline]
// CLIENTS concurrent clients each send REQUESTS_PER_CLIENT streamed greedy
// completions (prompts of 2 to 181 tokens, 8 to 64 out), then the same
// requests one at a time as the baseline (the same number of requests, of
// the same shapes). Prints requests/s, output
// tokens/s, and time to first token and inter-token latency (p50, p99).
import { createRequire } from 'node:module';
import path from 'node:path';

const [baseURL, clientsArg, perClientArg, baselineArg] = process.argv.slice(2);
const require = createRequire(path.join(process.env.DTP_NPM_PREFIX, 'node_modules', 'x.js'));
const OpenAI = require('openai');
const client = new OpenAI({ baseURL, apiKey: 'none', maxRetries: 0 });
const clients = Number(clientsArg), perClient = Number(perClientArg);
const text = 'In the beginning the serving engine had one queue, and every request waited for the one before it. ' +
             'Then the batch grew, and requests joined and left it at every token, each with its own blocks. ';
const model = (await client.models.list()).data[0].id;

async function one(i) {
  const t0 = performance.now();
  const prompt = text.slice(i % 11, i % 11 + 1 + (i * 37) % 180);
  const stream = await client.completions.create({ model, prompt, max_tokens: 8 + (i * 7) % 57,
                                                   temperature: 0, stream: true, stream_options: { include_usage: true } });
  let first = null, last = null, tokens = 0;
  const gaps = [];
  for await (const c of stream) {
    if (c.usage) tokens = c.usage.completion_tokens;
    if (!c.choices.length || !c.choices[0].text) continue;
    const now = performance.now();
    if (first === null) first = now - t0;
    else gaps.push(now - last);
    last = now;
  }
  return { ttft: first, gaps, tokens };
}

const pct = (xs, q) => {
  const s = [...xs].sort((a, b) => a - b);
  return s.length ? s[Math.min(s.length - 1, Math.floor(q * (s.length - 1) + 0.5))] : NaN;
};
function report(name, results, seconds) {
  const tokens = results.reduce((a, r) => a + r.tokens, 0);
  const ttft = results.map((r) => r.ttft).filter((x) => x !== null), itl = results.flatMap((r) => r.gaps);
  console.log(`serve_bench: ${name}: ${results.length} requests in ${seconds.toFixed(2)} s: ` +
              `${(results.length / seconds).toFixed(2)} req/s, ${(tokens / seconds).toFixed(1)} output tokens/s, ` +
              `TTFT p50 ${pct(ttft, 0.5).toFixed(1)} ms p99 ${pct(ttft, 0.99).toFixed(1)} ms, ` +
              `ITL p50 ${pct(itl, 0.5).toFixed(1)} ms p99 ${pct(itl, 0.99).toFixed(1)} ms`);
  return tokens / seconds;
}

let t0 = performance.now();
const loaded = (await Promise.all(Array.from({ length: clients }, async (_, c) => {
  const out = [];
  for (let k = 0; k < perClient; k++) out.push(await one(c * perClient + k));
  return out;
}))).flat();
const concurrent = report(`${clients} clients x ${perClient}`, loaded, (performance.now() - t0) / 1000);
if (baselineArg === '--no-baseline') process.exit(0);  // serve_test.sh's comparisons: the load alone
t0 = performance.now();
const serial = [];
for (let i = 0; i < clients * perClient; i++) serial.push(await one(i));
const baseline = report('one at a time', serial, (performance.now() - t0) / 1000);
console.log(`serve_bench: throughput ${(concurrent / baseline).toFixed(2)}x the one-at-a-time baseline`);
