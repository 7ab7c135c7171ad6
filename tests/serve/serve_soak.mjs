// A soak of a running dtp-serve (see serve_test.sh --soak):
//   node serve_soak.mjs BASE_URL REQUESTS RANK_PIDS
// REQUESTS requests from 16 concurrent clients: prompts of 2 to 39 tokens,
// 1 to 24 out, greedy and seeded, streamed and not, and every 25th stream
// aborted after its first piece; the server's pool is small, so sequences
// are preempted too. Then:
//  - every request that was not aborted got all its tokens (length) or a stop;
//  - every KV block is back and nothing runs (/metrics);
//  - memory is flat: each rank's resident set (RANK_PIDS, comma-separated)
//    after the run is within 32 MiB of what it was after the first 10% of
//    the requests. Why 32 MiB: the KV pool and the model are allocated
//    before the first request, and a request's own state (its tokens, text
//    and generator) is a few KiB; a leak of 64 KiB per request (a block
//    table, a generator or a response kept) would add 57 MiB over 900
//    requests, while allocator caches and the 64 HTTP threads' arenas
//    settle during the warm-up.
// Exits 1 naming each failed check.
import { readFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import path from 'node:path';

import { checker } from './checks.mjs';

const [baseURL, requestsArg, pidsArg] = process.argv.slice(2);
const require = createRequire(path.join(process.env.DTP_NPM_PREFIX, 'node_modules', 'x.js'));
const OpenAI = require('openai');
const client = new OpenAI({ baseURL, apiKey: 'none', maxRetries: 0, timeout: 120000 });
const total = Number(requestsArg), clients = 16;
const pids = pidsArg.split(',').filter(Boolean).map(Number);

const { check, failed } = checker('serve_soak');
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const rssKiB = (pid) => Number(readFileSync(`/proc/${pid}/status`, 'utf8').match(/^VmRSS:\s+(\d+) kB$/m)[1]);
async function metrics() {
  const text = await (await fetch(baseURL.replace(/\/v1$/, '/metrics'))).text();
  const get = (name) => Number(text.match(new RegExp(`^${name} (\\S+)$`, 'm'))[1]);
  return { used: get('dtp_serve_kv_blocks_used'), total: get('dtp_serve_kv_blocks_total'), running: get('dtp_serve_running'),
           preemptions: get('dtp_serve_preemptions_total'), cancelled: get('dtp_serve_requests_cancelled_total') };
}

const model = (await client.models.list()).data[0].id;
const text = 'a soak test sends many requests of many shapes to the server and checks what comes back. ';
let next = 0, done = 0, aborted = 0, tokens = 0;
let warm = null;

async function one(i) {
  const prompt = text.slice(i % 7, i % 7 + 1 + (i * 13) % 38);  // + BOS + 24 out fits a context of 64
  const max_tokens = 1 + (i * 7) % 24;
  const sampling = i % 3 === 0 ? { temperature: 0.8, top_p: 0.9, seed: i } : { temperature: 0 };
  if (i % 2 === 0) {
    const r = await client.completions.create({ model, prompt, max_tokens, ...sampling });
    const c = r.choices[0];
    check(c.finish_reason === 'stop' || r.usage.completion_tokens === max_tokens,
          `request ${i}: ${r.usage.completion_tokens} of ${max_tokens} tokens, finish ${c.finish_reason}`);
    tokens += r.usage.completion_tokens;
    return;
  }
  const abort = new AbortController();
  const stream = await client.completions.create({ model, prompt, max_tokens, ...sampling, stream: true,
                                                   stream_options: { include_usage: true } }, { signal: abort.signal });
  let finish = null, usage = null, gone = false;
  try {
    for await (const c of stream) {
      if (c.usage) usage = c.usage;
      if (!c.choices.length) continue;
      finish = c.choices[0].finish_reason ?? finish;
      if (i % 25 === 1 && c.choices[0].text && !gone) {
        abort.abort();
        aborted++;
        gone = true;
        break;  // iterating on after the abort may wait forever (the stream's next() never settles)
      }
    }
  } catch (e) {
    if (!gone) throw e;
  }
  if (gone) return;
  check(usage && (finish === 'stop' || usage.completion_tokens === max_tokens),
        `stream ${i}: ${usage && usage.completion_tokens} of ${max_tokens} tokens, finish ${finish}`);
  if (usage) tokens += usage.completion_tokens;
}

const t0 = performance.now();
await Promise.all(Array.from({ length: clients }, async () => {
  while (next < total) {
    const i = next++;
    try {
      await one(i);
    } catch (e) {
      check(false, `request ${i}: ${e.status ?? ''} ${e.message}`);
    }
    if (++done === Math.floor(total / 10)) warm = pids.map(rssKiB);
  }
}));
const seconds = (performance.now() - t0) / 1000;
let m = await metrics();
for (let k = 0; k < 200 && (m.used > 0 || m.running > 0); k++) {
  await sleep(50);
  m = await metrics();
}
const end = pids.map(rssKiB);
check(m.used === 0 && m.running === 0, `after ${total} requests: ${m.used} of ${m.total} KV blocks still held, ${m.running} running`);
pids.forEach((pid, r) => {
  check(end[r] - warm[r] <= 32 * 1024, `rank process ${pid}: resident set ${warm[r] >> 10} MiB after ${Math.floor(total / 10)} requests, ${end[r] >> 10} MiB after ${total} (bound: +32 MiB)`);
});
console.log(`serve_soak: ${total} requests (${aborted} aborted streams) in ${seconds.toFixed(1)} s, ${tokens} tokens, ` +
            `${m.preemptions} preemptions, ${m.cancelled} cancelled; KV blocks ${m.used}/${m.total} held at the end; ` +
            `RSS per rank (MiB) after ${Math.floor(total / 10)}: ${warm.map((x) => (x / 1024).toFixed(1)).join(', ')}, ` +
            `after ${total}: ${end.map((x) => (x / 1024).toFixed(1)).join(', ')}`);
if (failed()) process.exit(1);
console.log('serve_soak: ok');
