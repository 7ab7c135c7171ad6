// dtp-serve's chat page (/) in headless Chromium (see chat_page_test.sh):
//   node chat_page_test.mjs URL CHROMIUM USER_DATA_DIR SHOT_DIR
// Types into the page as a user would and reads the streamed reply from it:
// - turn 1: the page's request is the chat with "stream": true, its text
//   takes on exactly the prefixes the server's streamed deltas build, in
//   order, and ends equal to the API's greedy (temperature 0) answer to the
//   same chat;
// - turn 2 (Enter): the request carries the whole conversation; the API
//   answers it (200) and the page shows its greedy reply;
// - a refused request (max_tokens past the context): the page shows the
//   API's error message;
// - screenshots SHOT_DIR/chat_page.png and chat_page_error.png.
// Exits 1 naming each failed check.
import { createRequire } from 'node:module';
import path from 'node:path';

import { checker, same, show } from './checks.mjs';

const [url, chromiumPath, userDataDir, shotDir] = process.argv.slice(2);
const require = createRequire(path.join(process.env.DTP_NPM_PREFIX, 'node_modules', 'x.js'));
const { chromium } = require('playwright-core');

const { check, failed } = checker('chat_page_test');

// The API's own answer to a (non-streamed) request: {status, body}.
async function api(body) {
  const res = await fetch(new URL('v1/chat/completions', url), {
    method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body),
  });
  return { status: res.status, body: await res.json() };
}

const model = (await (await fetch(new URL('v1/models', url))).json()).data[0].id;
const maxTokens = 16;

const context = await chromium.launchPersistentContext(userDataDir, {
  executablePath: chromiumPath,
  headless: true,
  timeout: 120000,
  viewport: { width: 1000, height: 680 },
  args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
         '--disable-background-networking', '--disable-component-update', '--disable-sync'],
});
try {
  const page = context.pages()[0] ?? await context.newPage();
  page.setDefaultTimeout(60000);
  page.on('pageerror', (e) => check(false, `page error: ${e.message}`));
  page.on('console', (m) => { if (m.type() === 'error') console.log(`chat_page_test: console: ${m.text()}`); });
  const sent = [];  // the bodies the page POSTs to /v1/chat/completions
  page.on('request', (r) => {
    if (r.method() === 'POST' && r.url().endsWith('/v1/chat/completions')) sent.push(JSON.parse(r.postData()));
  });
  const streams = [];  // the server-sent event bodies it gets back, in order
  page.on('response', (r) => {
    if (r.request().method() === 'POST' && r.url().endsWith('/v1/chat/completions')) streams.push(r.text());
  });

  await page.goto(url);
  await page.waitForFunction((m) => document.getElementById('model').textContent.startsWith(m), model);
  await page.click('summary');
  await page.fill('#temperature', '0');
  await page.fill('#max-tokens', String(maxTokens));
  // Every value the page's text nodes take on, in order (oldValue of each
  // change): a reply appended piece by piece leaves its prefixes here.
  await page.evaluate(() => {
    window.seen = [];
    new MutationObserver((records) => {
      for (const r of records) if (r.type === 'characterData') window.seen.push(r.oldValue);
    }).observe(document.getElementById('messages'), { subtree: true, characterData: true, characterDataOldValue: true });
  });
  // The conversation as the page shows it, once `n` turns have ended.
  const turns = async (n) => {
    await page.waitForFunction((k) => document.querySelectorAll('.msg[data-state="done"]').length >= k, n);
    return page.$$eval('.msg', (els) => els.map((e) => ({
      kind: e.className.replace('msg ', ''),
      text: e.querySelector('.text').textContent,
      note: e.querySelector('.note')?.textContent ?? null,
    })));
  };

  // Turn 1: type, press Send.
  const first = 'Hello there, who are you?';
  await page.fill('#input', first);
  await page.click('#send');
  const t1 = await turns(1);
  const messages1 = [{ role: 'user', content: first }];
  check(same(sent[0], { messages: messages1, stream: true, model, temperature: 0, max_tokens: maxTokens }),
        `turn 1 request body ${show(sent[0])}`);
  const want1 = await api({ model, messages: messages1, temperature: 0, max_tokens: maxTokens });
  check(want1.status === 200, `turn 1 API answer ${want1.status} ${show(want1.body)}`);
  const reply1 = want1.body.choices[0].message.content;
  check(t1.length === 2 && same(t1[0], { kind: 'user', text: first, note: null }) && t1[1].kind === 'assistant',
        `turn 1 on the page: ${show(t1)}`);
  check(t1[1].text === reply1, `turn 1 reply on the page ${show(t1[1].text)} vs the API's greedy ${show(reply1)}`);
  const wantNote = want1.body.choices[0].finish_reason === 'length' ? 'stopped at max tokens' : null;
  check(t1[1].note === wantNote, `turn 1 note ${show(t1[1].note)}, finish_reason ${want1.body.choices[0].finish_reason}`);
  // The page shows each streamed piece as it comes: its text takes on, in
  // order, the prefixes the server's deltas build (how many pieces the
  // server sends depends on timing: it sends what has decoded when it writes).
  const pieces = [];
  for (const line of (await streams[0]).split('\n')) {
    if (!line.startsWith('data: ') || line === 'data: [DONE]') continue;
    const delta = JSON.parse(line.slice(6)).choices?.[0]?.delta?.content;
    if (delta) pieces.push(delta);
  }
  const prefixes = [''];
  for (const p of pieces) prefixes.push(prefixes[prefixes.length - 1] + p);
  const seen = await page.evaluate(() => window.seen);
  const values = [...seen, t1[1].text];
  check(same(values, prefixes),
        `turn 1 was not appended piece by piece as streamed: the reply's text took the values ${show(values)}, the server's deltas build ${show(prefixes)}`);
  console.log(`chat_page_test.mjs: turn 1: ${show(t1[1].text)} in ${pieces.length} streamed pieces`);

  // Turn 2: type, press Enter; the request carries the whole conversation.
  const second = 'Tell me more.';
  await page.fill('#input', second);
  await page.press('#input', 'Enter');
  const t2 = await turns(2);
  const messages2 = [...messages1, { role: 'assistant', content: reply1 }, { role: 'user', content: second }];
  check(same(sent[1], { messages: messages2, stream: true, model, temperature: 0, max_tokens: maxTokens }),
        `turn 2 request body ${show(sent[1])}`);
  const want2 = await api({ model, messages: messages2, temperature: 0, max_tokens: maxTokens });
  const shown2 = t2.slice(2);
  // dtp-serve takes the whole conversation (earlier turns included).
  check(want2.status === 200, `turn 2 API answer ${want2.status} ${show(want2.body)}`);
  const reply2 = want2.body.choices?.[0]?.message?.content;
  check(shown2.length === 2 && same(shown2[0], { kind: 'user', text: second, note: null }) &&
        shown2[1].kind === 'assistant' && shown2[1].text === reply2,
        `turn 2 on the page ${show(shown2)} vs the API's greedy ${show(reply2)}`);
  console.log(`chat_page_test.mjs: turn 2: ${show(reply2)}`);
  await page.screenshot({ path: path.join(shotDir, 'chat_page.png') });

  // A refused request after New chat: the page shows the error body's message.
  await page.click('#new-chat');
  await page.fill('#max-tokens', '100000');
  await page.fill('#input', first);
  await page.click('#send');
  const t3 = await turns(1);
  check(same(sent[2], { messages: messages1, stream: true, model, temperature: 0, max_tokens: 100000 }),
        `after New chat: request body ${show(sent[2])}`);
  const want3 = await api({ model, messages: messages1, temperature: 0, max_tokens: 100000 });
  check(want3.status === 400 && t3.length === 2 && t3[1].kind === 'error' && t3[1].text === want3.body.error.message,
        `a refused request on the page ${show(t3)} vs the API's ${want3.status} ${show(want3.body)}`);
  await page.screenshot({ path: path.join(shotDir, 'chat_page_error.png') });
} finally {
  await context.close();
}
process.exit(failed() ? 1 : 0);
