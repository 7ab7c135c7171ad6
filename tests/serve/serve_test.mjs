// dtp-serve checked with OpenAI's Node client (see serve_test.sh):
//   node serve_test.mjs BASE_URL CHAT_URL DTPRUN GREEDY_REFERENCE WORKDIR
// BASE_URL serves the byte-vocabulary model (completions), CHAT_URL the same
// weights with a ChatML tokenizer. Exits 1 naming each failed check.
import { execFileSync } from 'node:child_process';
import { writeFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import path from 'node:path';

import { checker, same } from './checks.mjs';

const [baseURL, chatURL, dtprun, reference, work] = process.argv.slice(2);
const require = createRequire(path.join(process.env.DTP_NPM_PREFIX, 'node_modules', 'x.js'));
const OpenAI = require('openai');
const base = new OpenAI({ baseURL, apiKey: 'none', maxRetries: 0 });
const chat = new OpenAI({ baseURL: chatURL, apiKey: 'none', maxRetries: 0 });

const { check, failed } = checker('serve_test');

// models::generate's tokens for each [prompt ids, max_tokens, stop ids], each
// prompt alone, at TP=2 (dtp-generate's code path).
function referenceTokens(cases) {
  const file = path.join(work, 'cases.txt');
  writeFileSync(file, cases.map(([ids, n, stops]) => `${n} ${stops.length ? stops.join(',') : '-'} ${ids.join(' ')}`).join('\n') + '\n');
  const out = execFileSync(dtprun, ['-n', '2', reference, path.join(work, 'hf'), '64', file], { encoding: 'utf8' });
  return out.split('\n').filter((l) => l.includes('reference:')).map((l) => l.split('reference:')[1].trim().split(/\s+/).filter(Boolean).map(Number));
}

const models = await base.models.list();
const modelName = models.data[0].id;
check(models.data.length === 1 && models.data[0].object === 'model', `/v1/models: ${JSON.stringify(models.data)}`);

// 1. Greedy completions equal models::generate's tokens, token for token.
const prompts = ['The ', 'A man walks into', 'Q: What is', 'You will', 'Never'];
const complete = (prompt, extra = {}) =>
  base.completions.create({ model: modelName, prompt, max_tokens: 24, temperature: 0, return_token_ids: true, ...extra });
const alone = [];
for (const p of prompts) alone.push(await complete(p));
const ref = referenceTokens(alone.map((r) => [r.prompt_token_ids, 24, []]));
alone.forEach((r, i) => {
  check(same(r.choices[0].token_ids, ref[i]), `greedy '${prompts[i]}': server ${JSON.stringify(r.choices[0].token_ids)} vs generate ${JSON.stringify(ref[i])}`);
  check(r.usage.prompt_tokens === r.prompt_token_ids.length && r.usage.completion_tokens === 24 &&
        r.usage.total_tokens === r.usage.prompt_tokens + 24 && r.choices[0].finish_reason === 'length',
        `usage/finish of '${prompts[i]}': ${JSON.stringify(r.usage)} ${r.choices[0].finish_reason}`);
  check(r.choices[0].text === Buffer.from(r.choices[0].token_ids).toString('utf8'), `text of '${prompts[i]}' is not its bytes`);
});

// 1b. Completions' logprobs name each token by its text (a byte here), one
// byte of text_offset each; top_logprobs holds the 3 best and the drawn token.
const withLogprobs = await complete(prompts[1], { logprobs: 3 });
const lp = withLogprobs.choices[0].logprobs, ids = withLogprobs.choices[0].token_ids;
check(same(ids, alone[1].choices[0].token_ids) && lp && same(lp.tokens, ids.map((t) => Buffer.from([t]).toString('utf8'))) &&
      same(lp.text_offset, ids.map((_, j) => j)) &&
      lp.top_logprobs.every((top, j) => Object.keys(top).length >= 3 && Object.keys(top).length <= 4 && top[lp.tokens[j]] === lp.token_logprobs[j]),
      `completion logprobs 3: ${JSON.stringify(lp).slice(0, 300)} for tokens ${JSON.stringify(ids)}`);

// 2. Concurrent requests (mixed lengths, one sampled with a seed) equal the
// same requests alone: joining and leaving a running batch changes nothing.
const sampledAlone = await complete('The ', { temperature: 0.9, top_k: 20, seed: 7 });
const metric = async (name) => {
  const text = await (await fetch(baseURL.replace(/\/v1$/, '/metrics'))).text();
  return Number(text.match(new RegExp(`^${name} (\\S+)$`, 'm'))[1]);
};
const [steps0, tokens0] = [await metric('dtp_serve_steps_total'), await metric('dtp_serve_generation_tokens_total')];
const jobs = [];
for (let i = 0; i < 8; i++) jobs.push(complete(prompts[i % prompts.length], { max_tokens: 24 - 2 * (i % 3) }));
jobs.push(complete('The ', { temperature: 0.9, top_k: 20, seed: 7 }));
const together = await Promise.all(jobs);
const [steps, tokens] = [await metric('dtp_serve_steps_total') - steps0, await metric('dtp_serve_generation_tokens_total') - tokens0];
check(tokens === 202 && steps <= tokens / 3, `concurrent requests: ${tokens} tokens in ${steps} steps, expected 8 x (24, 22 or 20) + 24 = 202 tokens in batches (at most a third as many steps)`);
console.log(`serve_test.mjs: 9 concurrent requests: ${tokens} tokens in ${steps} steps`);
together.slice(0, 8).forEach((r, i) => {
  const want = alone[i % prompts.length].choices[0].token_ids.slice(0, 24 - 2 * (i % 3));
  check(same(r.choices[0].token_ids, want), `concurrent request ${i}: ${JSON.stringify(r.choices[0].token_ids)} vs alone ${JSON.stringify(want)}`);
});
check(same(together[8].choices[0].token_ids, sampledAlone.choices[0].token_ids),
      `seeded sample in a batch ${JSON.stringify(together[8].choices[0].token_ids)} vs alone ${JSON.stringify(sampledAlone.choices[0].token_ids)}`);

// 3. Streaming completions assemble to the non-streamed text.
const stream = await base.completions.create({ model: modelName, prompt: prompts[1], max_tokens: 24, temperature: 0, stream: true });
let streamed = '', chunks = 0, finish = null;
for await (const c of stream) {
  streamed += c.choices[0].text;
  finish = c.choices[0].finish_reason ?? finish;
  chunks++;
}
check(streamed === alone[1].choices[0].text && chunks > 2 && finish === 'length',
      `streamed completion '${streamed}' (${chunks} chunks, ${finish}) vs '${alone[1].choices[0].text}'`);

// 4. A stop string ends the text before it.
const full = alone[0].choices[0].text;
const stopAt = full.slice(3, 5);
const stopped = await complete(prompts[0], { stop: [stopAt] });
check(stopped.choices[0].text === full.slice(0, full.indexOf(stopAt)) && stopped.choices[0].finish_reason === 'stop',
      `stop '${stopAt}': got '${stopped.choices[0].text}' (${stopped.choices[0].finish_reason}), full '${full}'`);

// 5. Chat: streamed equals non-streamed; tokens equal generate's, stopping at
// the ChatML end of turn.
const messages = [{ role: 'system', content: 'be brief' }, { role: 'user', content: 'hi' }];
const reply = await chat.chat.completions.create({ model: 'chat', messages, max_tokens: 20, temperature: 0, return_token_ids: true });
const chatStream = await chat.chat.completions.create({ model: 'chat', messages, max_tokens: 20, temperature: 0, stream: true,
                                                        stream_options: { include_usage: true } });
let chatText = '', role = null, usage = null;
for await (const c of chatStream) {
  if (c.usage) usage = c.usage;
  if (!c.choices.length) continue;
  role = c.choices[0].delta.role ?? role;
  chatText += c.choices[0].delta.content ?? '';
}
check(role === 'assistant' && chatText === reply.choices[0].message.content,
      `chat stream '${chatText}' (role ${role}) vs '${reply.choices[0].message.content}'`);
check(usage && same(usage, reply.usage), `chat stream usage ${JSON.stringify(usage)} vs ${JSON.stringify(reply.usage)}`);
check(reply.usage.prompt_tokens === 38, `chat prompt: ${reply.usage.prompt_tokens} tokens, expected 38 (ChatML, special tokens as ids)`);
const chatRef = referenceTokens([[reply.prompt_token_ids, 20, [37]]])[0];
check(same(reply.choices[0].token_ids, chatRef), `chat tokens ${JSON.stringify(reply.choices[0].token_ids)} vs generate ${JSON.stringify(chatRef)}`);

// 5b. A conversation: the whole messages array goes to the template (its
// rendering is compared with Hugging Face's in tests/tokenizers/); the reply
// continues that prompt as generate does. A role order the template does not
// take is a 400 naming it.
const turns = [{ role: 'user', content: 'hi' }, { role: 'assistant', content: 'hey' }, { role: 'user', content: 'ok' }];
const reply2 = await chat.chat.completions.create({ model: 'chat', messages: turns, max_tokens: 8, temperature: 0, return_token_ids: true });
const single = await chat.chat.completions.create({ model: 'chat', messages: turns.slice(2), max_tokens: 1, return_token_ids: true });
check(reply2.prompt_token_ids.length > single.prompt_token_ids.length + 10,
      `a 3-message chat's prompt has ${reply2.prompt_token_ids.length} tokens, one message's ${single.prompt_token_ids.length}`);
const chatRef2 = referenceTokens([[reply2.prompt_token_ids, 8, [37]]])[0];
check(same(reply2.choices[0].token_ids, chatRef2), `multi-turn chat tokens ${JSON.stringify(reply2.choices[0].token_ids)} vs generate ${JSON.stringify(chatRef2)}`);
const badOrder = await fetch(`${chatURL}/chat/completions`, { method: 'POST', headers: { 'content-type': 'application/json' },
  body: JSON.stringify({ model: 'chat', messages: [{ role: 'user', content: 'hi' }, { role: 'user', content: 'hi' }] }) });
const badBody = await badOrder.json();
check(badOrder.status === 400 && badBody.error.param === 'messages' &&
      badBody.error.message.includes('bad role order for the ChatML chat template') && badBody.error.message.includes('got [user, user]'),
      `two user messages in a row: got ${badOrder.status} ${JSON.stringify(badBody)}, expected a 400 naming the role order`);

// 6. Bad requests: 4xx with OpenAI's error body naming the field; the server
// keeps serving.
async function expectError(body, status, param, url = `${baseURL}/completions`) {
  const res = await fetch(url, { method: 'POST', headers: { 'content-type': 'application/json' },
                                 body: typeof body === 'string' ? body : JSON.stringify(body) });
  const j = await res.json().catch(() => null);
  check(res.status === status && j && j.error && j.error.param === param && typeof j.error.message === 'string' &&
        'type' in j.error && 'code' in j.error,
        `bad request ${typeof body === 'string' ? body : JSON.stringify(body).slice(0, 80)}: got ${res.status} ${JSON.stringify(j)}, expected ${status} naming ${param}`);
}
await expectError('{"prompt": "x", ', 400, null);
await expectError({ prompt: 'x', max_tokens: 0 }, 400, 'max_tokens');
await expectError({ prompt: 'x', max_tokens: 'many' }, 400, 'max_tokens');
await expectError({ prompt: 'x', temperature: 'hot' }, 400, 'temperature');
await expectError({ prompt: 'x', top_p: 0 }, 400, 'top_p');
await expectError({ prompt: 'x', stop: 5 }, 400, 'stop');
await expectError({ prompt: 'x'.repeat(64) }, 400, 'prompt');
await expectError({ prompt: 'x'.repeat(40), max_tokens: 30 }, 400, 'max_tokens');
await expectError({ prompt: [1, 2, 999] }, 400, 'prompt');
await expectError({ prompt: 'x', model: 'gpt-4' }, 404, 'model');
await expectError({ prompt: 'x', n: 17 }, 400, 'n');
await expectError({ messages: [{ role: 'user', content: 'hi' }] }, 400, 'messages', `${baseURL}/chat/completions`);
await expectError({ messages: 'hi' }, 400, 'messages', `${chatURL}/chat/completions`);
try {
  await base.completions.create({ model: modelName, prompt: 'x', max_tokens: -1 });
  check(false, 'the client got no error for max_tokens -1');
} catch (e) {
  check(e.status === 400 && e.param === 'max_tokens', `the client's error for max_tokens -1: ${e.status} ${e.param} ${e.message}`);
}
const after = await complete(prompts[0]);
check(same(after.choices[0].token_ids, alone[0].choices[0].token_ids), 'the server answers differently after bad requests');

if (failed()) process.exit(1);
console.log(`serve_test.mjs: ${prompts.length} greedy prompts equal generate's, 9 concurrent equal alone, streaming, stop, chat, 14 bad requests: ok`);
