// dtp-serve's logprobs, n choices, prefix caching and a hung-up
// non-streamed client, with OpenAI's Node client (see serve_test.sh
// --features):
//   node serve_features_test.mjs URL DTPRUN GREEDY_REFERENCE WORKDIR CONTEXT
// URL serves the tiny model in float64 at TP=2 with the ChatML tokenizer
// (completions and chat), --enable-prefix-caching. Checks:
//  1. logprobs (completions `logprobs: 5`, chat `logprobs: true,
//     top_logprobs: 3`) equal one device's at::log_softmax of the forward
//     logits (greedy_reference TOP_K float64, no engine, no KV cache) within
//     1e-9, and the top ids are its top-k's (ids via vLLM's
//     return_tokens_as_token_ids); streamed logprobs assemble to the
//     non-streamed ones (within 1e-9: a prompt found in the prefix cache is
//     summed in another order); text_offset counts the token texts (their
//     texts are checked on the byte tokenizer in serve_test.mjs);
//  2. n = 3 greedy gives three equal choices equal to the reference; n = 2
//     seeded equals two requests with seed and seed + 1; streamed n = 2
//     chunks carry their index and assemble to the non-streamed choices;
//     usage counts the prompt once and every choice's tokens;
//  3. 400s naming the field: top_logprobs without logprobs, out of range,
//     n out of [1, 16], completions logprobs out of [0, 20];
//  4. a prompt sent twice: the second finds its full blocks in the prefix
//     cache (/metrics hits), with the same tokens;
//  5. a non-streamed request whose client aborts mid-generation is cancelled
//     (dtp_serve_requests_cancelled_total + 1) and its KV blocks return.
// Exits 1 naming each failed check.
//
// The tolerance, 1e-9: server and reference both run float64 (dtp-serve
// --dtype float64); they differ only in summation order (the TP=2 row-
// parallel all-reduce, the paged attention), each about 1e-16 relative per
// operation over a few hundred terms of size < 100 in this model, so the
// logprobs agree to ~1e-13; 1e-9 has a margin of 1e4 over that and is still
// 1e2 below float32's rounding (~1e-7 at these magnitudes), so serving in
// float32 by mistake, a wrong position or a wrong token fails it.
import { execFileSync } from 'node:child_process';
import { writeFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import path from 'node:path';

import { checker, same, show } from './checks.mjs';

const [baseURL, dtprun, reference, work, context] = process.argv.slice(2);
const require = createRequire(path.join(process.env.DTP_NPM_PREFIX, 'node_modules', 'x.js'));
const OpenAI = require('openai');
const client = new OpenAI({ baseURL, apiKey: 'none', maxRetries: 0, timeout: 120000 });
const metricsURL = baseURL.replace(/\/v1$/, '/metrics');
const { check, failed } = checker('serve_features_test');
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const tol = 1e-9;

async function metrics() {
  const text = await (await fetch(metricsURL)).text();
  const get = (name) => {
    const m = text.match(new RegExp(`^${name} (\\S+)$`, 'm'));
    check(m, `/metrics has no ${name}`);
    return m ? Number(m[1]) : NaN;
  };
  return { cancelled: get('dtp_serve_requests_cancelled_total'), used: get('dtp_serve_kv_blocks_used'),
           running: get('dtp_serve_running'), tokens: get('dtp_serve_generation_tokens_total'),
           queries: get('dtp_serve_prefix_cache_queries_total'), hits: get('dtp_serve_prefix_cache_hits_total') };
}

// One device's [token, logprob, [[id, logprob] x k]] per new token, and the
// new tokens, for each [prompt ids, new tokens] (greedy, no stop tokens).
function referenceLogprobs(cases, k) {
  const file = path.join(work, 'features_cases.txt');
  writeFileSync(file, cases.map(([ids, n]) => `${n} - ${ids.join(' ')}`).join('\n') + '\n');
  const out = execFileSync(dtprun, ['-n', '1', reference, path.join(work, 'chat'), context, file, String(k), 'float64'],
                           { encoding: 'utf8' });
  return out.split('\n').filter((l) => l.includes('logprobs: ')).map((l) => JSON.parse(l.split('logprobs: ')[1]));
}
// a and b alike, numbers within tol, objects whatever their key order: the
// same request's logprobs differ in the last bits when its prompt's KV
// came from the prefix cache (another summation order).
function near(a, b) {
  if (typeof a === 'number' && typeof b === 'number') return Math.abs(a - b) <= tol;
  if (Array.isArray(a) && Array.isArray(b)) return a.length === b.length && a.every((x, i) => near(x, b[i]));
  if (a && b && typeof a === 'object' && typeof b === 'object') {
    const ka = Object.keys(a).sort(), kb = Object.keys(b).sort();
    return same(ka, kb) && ka.every((k) => near(a[k], b[k]));
  }
  return a === b;
}
const idOf = (s) => (s.startsWith('token_id:') ? Number(s.slice('token_id:'.length)) : NaN);

// Compares one choice's [id, logprob, [[id, logprob]...]] per token with the
// reference's; returns the largest difference, checks the ids.
function compareLogprobs(what, got, want) {
  let worst = 0;
  check(got.length === want.length, `${what}: ${got.length} tokens with logprobs, reference ${want.length}`);
  for (let j = 0; j < Math.min(got.length, want.length); j++) {
    const [gt, glp, gtop] = got[j], [wt, wlp, wtop] = want[j];
    check(gt === wt, `${what}: token ${j} is ${gt}, reference ${wt}`);
    worst = Math.max(worst, Math.abs(glp - wlp));
    check(same(gtop.map((x) => x[0]), wtop.map((x) => x[0])),
          `${what}: token ${j}'s top ids ${show(gtop.map((x) => x[0]))}, reference ${show(wtop.map((x) => x[0]))}`);
    gtop.forEach((x, i) => { if (wtop[i]) worst = Math.max(worst, Math.abs(x[1] - wtop[i][1])); });
  }
  check(worst <= tol, `${what}: logprobs differ from one device's float64 log_softmax by ${worst}, bound ${tol}`);
  return worst;
}

const model = (await client.models.list()).data[0].id;

// 1a. Completions, logprobs 5.
const prompts = ['The ', 'A man walks into', 'Q: What is'];
const complete = (prompt, extra = {}) =>
  client.completions.create({ model, prompt, max_tokens: 12, temperature: 0, return_token_ids: true, ...extra });
const withIds = [], withText = [];
for (const p of prompts) {
  withIds.push(await complete(p, { logprobs: 5, return_tokens_as_token_ids: true }));
  withText.push(await complete(p, { logprobs: 5 }));
}
const ref5 = referenceLogprobs(withIds.map((r) => [r.prompt_token_ids, r.choices[0].token_ids.length]), 5);
let worst = 0;
withIds.forEach((r, i) => {
  const lp = r.choices[0].logprobs;
  check(lp && lp.tokens.length === r.choices[0].token_ids.length && lp.top_logprobs.length === lp.tokens.length,
        `completion '${prompts[i]}': logprobs ${show(lp)} for ${r.choices[0].token_ids.length} tokens`);
  if (!lp) return;
  // Completions' top_logprobs is a {text: logprob} map of the 5 best and the
  // drawn token: the 5 best by logprob are the reference's.
  const got = lp.tokens.map((t, j) => {
    const top = Object.entries(lp.top_logprobs[j]).map(([s, x]) => [idOf(s), x]);
    top.sort((a, b) => b[1] - a[1] || a[0] - b[0]);
    return [idOf(t), lp.token_logprobs[j], top.slice(0, 5)];
  });
  check(same(got.map((g) => g[0]), r.choices[0].token_ids), `completion '${prompts[i]}': logprobs tokens vs token_ids`);
  worst = Math.max(worst, compareLogprobs(`completion '${prompts[i]}'`, got, ref5[i]));
  const t = withText[i].choices[0];
  // Token texts: this model draws ids the ChatML tokenizer lacks (token_id:<id>);
  // serve_test.mjs checks texts and text_offset on the byte tokenizer.
  const offsets = t.logprobs.tokens.map((_, j) => Buffer.byteLength(t.logprobs.tokens.slice(0, j).join('')));
  check(same(t.logprobs.text_offset, offsets), `completion '${prompts[i]}': text_offset ${show(t.logprobs.text_offset)}, expected ${show(offsets)}`);
  check(near(t.logprobs.token_logprobs, lp.token_logprobs), `completion '${prompts[i]}': logprobs differ with token texts`);
});
// Streamed: the chunks' logprobs assemble to the non-streamed ones.
const cstream = await client.completions.create({ model, prompt: prompts[1], max_tokens: 12, temperature: 0, stream: true,
                                                  logprobs: 5, return_tokens_as_token_ids: true });
const assembled = { tokens: [], token_logprobs: [], top_logprobs: [], text_offset: [] };
for await (const ch of cstream) {
  const lp = ch.choices[0]?.logprobs;
  if (lp) for (const key of Object.keys(assembled)) assembled[key].push(...lp[key]);
}
check(near(assembled, withIds[1].choices[0].logprobs),
      `streamed completion logprobs ${show(assembled).slice(0, 300)} vs ${show(withIds[1].choices[0].logprobs).slice(0, 300)}`);

// 1b. Chat, top_logprobs 3, to the end of turn.
const messages = [{ role: 'system', content: 'be brief' }, { role: 'user', content: 'hi' }];
const chatReq = { model, messages, max_tokens: 20, temperature: 0, logprobs: true, top_logprobs: 3, return_token_ids: true,
                  return_tokens_as_token_ids: true };
const reply = await client.chat.completions.create(chatReq);
const content = reply.choices[0].logprobs?.content ?? [];
const ref3 = referenceLogprobs([[reply.prompt_token_ids, reply.choices[0].token_ids.length]], 3)[0];
worst = Math.max(worst, compareLogprobs('chat', content.map((c) => [idOf(c.token), c.logprob, c.top_logprobs.map((t) => [idOf(t.token), t.logprob])]), ref3));
check(content.every((c) => c.top_logprobs.length === 3), `chat logprobs: ${show(content[0])}: 3 top_logprobs expected`);
const chatStream = await client.chat.completions.create({ ...chatReq, stream: true });
const streamedContent = [];
for await (const ch of chatStream) streamedContent.push(...(ch.choices[0]?.logprobs?.content ?? []));
check(near(streamedContent, content), `streamed chat logprobs (${streamedContent.length} tokens) vs non-streamed (${content.length})`);
const plain = await client.chat.completions.create({ model, messages, max_tokens: 20, temperature: 0, logprobs: true });
// Token texts from the tokenizer; ids it does not know (the model has 256
// rows, the ChatML tokenizer 38 tokens) show as token_id:<id> without bytes.
const bytesOk = (c) => (c.bytes === null ? /^token_id:\d+$/.test(c.token) : same(c.bytes, [...Buffer.from(c.token)]));
check(plain.choices[0].logprobs.content.every((c) => c.top_logprobs.length === 0 && bytesOk(c)) &&
      plain.choices[0].logprobs.content.length === content.length,
      `chat logprobs: true without top_logprobs: ${show(plain.choices[0].logprobs).slice(0, 200)}`);
console.log(`serve_features_test.mjs: logprobs of ${prompts.length} completions and a chat within ${worst} of one device's (bound ${tol})`);

// 2. n choices.
const n3 = await complete(prompts[0], { n: 3 });
check(n3.choices.length === 3 && same(n3.choices.map((c) => c.index), [0, 1, 2]) &&
      n3.choices.every((c) => same(c.token_ids, withIds[0].choices[0].token_ids) && c.text === withIds[0].choices[0].text),
      `n=3 greedy: ${show(n3.choices.map((c) => [c.index, c.token_ids]))}, expected 3 x ${show(withIds[0].choices[0].token_ids)}`);
check(same(withIds[0].choices[0].token_ids, ref5[0].map((x) => x[0])), `greedy '${prompts[0]}' vs the reference's tokens`);
check(n3.usage.prompt_tokens === n3.prompt_token_ids.length && n3.usage.completion_tokens === 36 &&
      n3.usage.total_tokens === n3.usage.prompt_tokens + 36, `n=3 usage ${show(n3.usage)}: the prompt once, 3 x 12 tokens`);
const sampling = { temperature: 0.9, top_k: 20, max_tokens: 16 };
const n2 = await complete(prompts[1], { ...sampling, n: 2, seed: 5 });
const s5 = await complete(prompts[1], { ...sampling, seed: 5 }), s6 = await complete(prompts[1], { ...sampling, seed: 6 });
check(n2.choices.length === 2 && same(n2.choices[0].token_ids, s5.choices[0].token_ids) &&
      same(n2.choices[1].token_ids, s6.choices[0].token_ids) && !same(s5.choices[0].token_ids, s6.choices[0].token_ids),
      `n=2 seed 5: ${show(n2.choices.map((c) => c.token_ids))} vs seeds 5 and 6 alone ${show([s5.choices[0].token_ids, s6.choices[0].token_ids])}`);
const n2stream = await client.completions.create({ model, prompt: prompts[1], ...sampling, n: 2, seed: 5, stream: true,
                                                   stream_options: { include_usage: true } });
const texts = ['', ''], finishes = [null, null];
let streamUsage = null, badIndex = 0;
for await (const ch of n2stream) {
  if (ch.usage) streamUsage = ch.usage;
  for (const c of ch.choices) {
    if (c.index !== 0 && c.index !== 1) { badIndex++; continue; }
    texts[c.index] += c.text;
    finishes[c.index] = c.finish_reason ?? finishes[c.index];
  }
}
check(badIndex === 0 && same(texts, n2.choices.map((c) => c.text)) && same(finishes, n2.choices.map((c) => c.finish_reason)),
      `streamed n=2: ${show(texts)} (${show(finishes)}, ${badIndex} bad indices) vs ${show(n2.choices.map((c) => c.text))}`);
check(streamUsage && same(streamUsage, n2.usage), `streamed n=2 usage ${show(streamUsage)} vs ${show(n2.usage)}`);
const chat3 = await client.chat.completions.create({ model, messages, max_tokens: 20, temperature: 0, n: 3 });
check(chat3.choices.length === 3 && chat3.choices.every((c, i) => c.index === i && c.message.content === reply.choices[0].message.content),
      `chat n=3 greedy: ${show(chat3.choices.map((c) => c.message.content))} vs ${show(reply.choices[0].message.content)}`);

// 3. Bad requests name the field.
async function expectError(body, param, endpoint = 'completions') {
  const res = await fetch(`${baseURL}/${endpoint}`, { method: 'POST', headers: { 'content-type': 'application/json' },
                                                     body: JSON.stringify({ model, ...body }) });
  const j = await res.json().catch(() => null);
  check(res.status === 400 && j?.error?.param === param && typeof j.error.message === 'string' && j.error.message.startsWith(`${param}: got`),
        `${show(body)}: got ${res.status} ${show(j)}, expected a 400 naming ${param}`);
}
const chatBody = { messages };
await expectError({ ...chatBody, top_logprobs: 2 }, 'top_logprobs', 'chat/completions');
await expectError({ ...chatBody, logprobs: false, top_logprobs: 2 }, 'top_logprobs', 'chat/completions');
await expectError({ ...chatBody, logprobs: true, top_logprobs: 21 }, 'top_logprobs', 'chat/completions');
await expectError({ ...chatBody, logprobs: true, top_logprobs: -1 }, 'top_logprobs', 'chat/completions');
await expectError({ ...chatBody, logprobs: 3 }, 'logprobs', 'chat/completions');
await expectError({ prompt: 'x', logprobs: 21 }, 'logprobs');
await expectError({ prompt: 'x', logprobs: true }, 'logprobs');
await expectError({ prompt: 'x', n: 0 }, 'n');
await expectError({ prompt: 'x', n: 17 }, 'n');
await expectError({ ...chatBody, n: 1.5 }, 'n', 'chat/completions');

// 4. Prefix caching: the second of two equal prompts finds its full blocks.
const long = 'the quick brown fox jumps over the lazy dog and then it rests '.repeat(3);
const m0 = await metrics();
const first = await complete(long, { max_tokens: 4 });
const m1 = await metrics();
const second = await complete(long, { max_tokens: 4 });
const m2 = await metrics();
const promptLen = first.prompt_token_ids.length;
check(m1.queries - m0.queries >= promptLen - 1 && m2.queries - m1.queries >= promptLen - 1,
      `prefix cache queries went up by ${m1.queries - m0.queries} and ${m2.queries - m1.queries} for prompts of ${promptLen} tokens`);
check(m2.hits - m1.hits >= 16 && m2.hits - m1.hits < promptLen,
      `the second prompt of ${promptLen} tokens found ${m2.hits - m1.hits} in the prefix cache, expected its full 16-token blocks (>= 16, < ${promptLen})`);
check(same(first.choices[0].token_ids, second.choices[0].token_ids), `prefix-cached request: ${show(second.choices[0].token_ids)} vs ${show(first.choices[0].token_ids)}`);
console.log(`serve_features_test.mjs: prefix cache: ${m2.hits - m1.hits} of ${promptLen} prompt tokens found the second time`);

// 5. A non-streamed client that goes away: its request is cancelled.
const c0 = await metrics();
const abort = new AbortController();
const maxTokens = Number(context) - 8;
const pending = client.completions.create({ model, prompt: 'It is', max_tokens: maxTokens, temperature: 0 }, { signal: abort.signal })
  .then(() => 'finished', (e) => (e.name === 'APIUserAbortError' || abort.signal.aborted ? 'aborted' : `failed: ${e}`));
let c1 = await metrics();
for (let i = 0; i < 600 && c1.tokens - c0.tokens < 8; i++) {  // until it draws tokens (a hang bound, 60 s)
  await sleep(100);
  c1 = await metrics();
}
abort.abort();
const outcome = await pending;
let c2 = await metrics();
for (let i = 0; i < 600 && (c2.cancelled === c0.cancelled || c2.running > 0 || c2.used > 0); i++) {
  await sleep(100);
  c2 = await metrics();
}
check(outcome === 'aborted', `the aborted request: ${outcome}`);
check(c2.cancelled === c0.cancelled + 1 && c2.running === 0 && c2.used === 0 && c2.tokens - c0.tokens < maxTokens,
      `after the client aborted: cancelled ${c0.cancelled} -> ${c2.cancelled}, running ${c2.running}, ${c2.used} KV blocks used, ` +
      `${c2.tokens - c0.tokens} of ${maxTokens} tokens drawn; expected one more cancelled, none running or used, fewer tokens`);
console.log(`serve_features_test.mjs: aborted after ${c1.tokens - c0.tokens} tokens: cancelled after ${c2.tokens - c0.tokens} of ${maxTokens}`);

if (failed()) process.exit(1);
console.log('serve_features_test.mjs: logprobs, n choices, 10 bad requests, prefix caching, a hung-up client: ok');
