// dtp-serve stopped while clients hold connections (see serve_test.sh --stop):
//   node serve_stop_test.mjs BASE_URL
// On a server that runs one sequence at a time (--max-batch 1) it opens
//  - an idle keep-alive connection of OpenAI's Node client (after one
//    completion; the client keeps connections alive by default),
//  - a raw HTTP/1.1 connection, idle after one request (checked keep-alive),
//  - a raw connection that sends its request one byte every 200 ms and never
//    finishes it (without NOTE: [Open connections at shutdown] it holds rank
//    0 for as long as it sends),
//  - 6 streams of 200 tokens (the first runs, the others wait),
// then prints "serve_stop_test: holding" and, while the caller stops the
// server, checks that each stream ends as documented (its finish_reason, or
// the "shutting down" error event: queued, or not done within the grace) and
// that the server closes both raw connections. Exits 1 naming each failed
// check.
import { createRequire } from 'node:module';
import net from 'node:net';
import path from 'node:path';

import { checker } from './checks.mjs';

const [baseURL] = process.argv.slice(2);
const require = createRequire(path.join(process.env.DTP_NPM_PREFIX, 'node_modules', 'x.js'));
const OpenAI = require('openai');
const client = new OpenAI({ baseURL, apiKey: 'none', maxRetries: 0, timeout: 120000 });
const { hostname, port } = new URL(baseURL);

const { check, failed } = checker('serve_stop_test');
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const within = (promise, ms) => Promise.race([promise.then(() => true), sleep(ms).then(() => false)]);

// A raw connection: what came back, and whether the server closed it (its FIN).
function rawConnection() {
  const socket = net.connect(Number(port), hostname);
  const c = { socket, text: '', serverClosed: false, error: null };
  socket.setEncoding('utf8');
  socket.on('data', (d) => { c.text += d; });
  socket.on('end', () => { c.serverClosed = true; });
  socket.on('error', (e) => { c.error = e; });
  c.closed = new Promise((resolve) => socket.on('close', resolve));
  return c;
}
// Whether `text` holds one whole response with a Content-Length.
function wholeResponse(text) {
  const end = text.indexOf('\r\n\r\n');
  const length = text.match(/^content-length: *(\d+)/im);
  return end >= 0 && length !== null && text.length >= end + 4 + Number(length[1]);
}

const model = (await client.models.list()).data[0].id;
await client.completions.create({ model, prompt: 'keep me alive', max_tokens: 4 });

const idle = rawConnection();
idle.socket.write(`GET /health HTTP/1.1\r\nHost: ${hostname}\r\n\r\n`);
for (let i = 0; i < 600 && !wholeResponse(idle.text) && !idle.serverClosed; i++) await sleep(50);
check(wholeResponse(idle.text) && !/^connection: *close/im.test(idle.text) && !idle.serverClosed,
      `the raw connection's first response is not a whole keep-alive response: ${JSON.stringify(idle.text)}`);

const slow = rawConnection();
slow.socket.write(`GET /health HTTP/1.1\r\nHost: ${hostname}\r\nX-Slow: `);
let sent = 0;
const drip = setInterval(() => {
  if (slow.socket.destroyed || slow.serverClosed || ++sent > 600) clearInterval(drip);  // 600: 2 minutes at most
  else slow.socket.write('a');
}, 200);

async function follow(i, opened) {
  const out = { finish: null, error: null, tokens: 0 };
  try {
    const stream = await client.completions.create({ model, prompt: `stream ${i}: the`, max_tokens: 200, stream: true });
    opened();
    for await (const chunk of stream) {
      const choice = chunk.choices[0];
      if (choice?.text) out.tokens++;
      if (choice?.finish_reason) out.finish = choice.finish_reason;
    }
  } catch (e) {
    opened();
    out.error = String(e.message ?? e);
  }
  return out;
}
let open = 0;
const streams = Array.from({ length: 6 }, (_, i) => follow(i, () => open++));
for (let i = 0; i < 1200 && open < streams.length; i++) await sleep(50);
check(open === streams.length, `only ${open} of ${streams.length} streams started in 60 s`);

console.log(`serve_stop_test: holding an idle OpenAI client connection, an idle raw keep-alive connection, a slow ` +
            `request (${sent} bytes so far) and ${streams.length} streams`);

// The caller now stops the server.
const ends = await Promise.all(streams);
for (const [i, s] of ends.entries()) {
  check(((s.finish === 'length' || s.finish === 'stop') && s.error === null) ||
        (s.finish === null && s.error !== null && s.error.includes('shutting down')),
        `stream ${i} ended with neither a finish_reason nor the 'shutting down' event: ${JSON.stringify(s)}`);
}
for (const [name, c] of [['idle keep-alive', idle], ['slow request', slow]]) {
  check(await within(c.closed, 60000) && c.serverClosed,
        `the server did not close the ${name} connection within 60 s of the streams' end (error: ${c.error})`);
}
clearInterval(drip);
const finished = ends.filter((s) => s.finish !== null).length;
console.log(`serve_stop_test: ${finished} streams finished, ${ends.length - finished} ended 'shutting down'; ` +
            `the server closed both raw connections (the slow one after ${sent} bytes)`);
process.exit(failed() ? 1 : 0);
