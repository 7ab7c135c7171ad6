// llama.cpp's side of bench/decode_bench.sh: greedy decode of a GGUF file
// through npm's node-llama-cpp (its prebuilt CPU binaries), fed token ids,
// so that no tokenizer stands between it and dtp. Prints one JSON line:
// prefill ms over the prompt less its last token, each decode step's ms
// (one token in, one greedy token out), the tokens, and the process's peak
// RSS (kB; node's own ~50 MB included, the model's mmap-ed pages counted
// as they are touched).
//
//   NODE_PATH=<dir>/node_modules node bench/llama_cpp_decode.mjs --model m.gguf --prompt-ids 84,104,101 \
//       --tokens 16 --threads 2 --context 1024
import {createRequire} from "node:module";
import path from "node:path";

const args = Object.fromEntries(process.argv.slice(2).reduce((acc, a, i, all) => {
  if (a.startsWith("--")) acc.push([a.slice(2), all[i + 1]]);
  return acc;
}, []));
if (!args.model || !args["prompt-ids"]) {
  console.error("llama_cpp_decode: pass --model FILE.gguf --prompt-ids a,b,c [--tokens N --threads T --context C]");
  process.exit(2);
}
// node-llama-cpp where decode_bench.sh installed it (--modules), else the usual resolution.
const req = createRequire(path.join(args.modules || process.cwd(), "node_modules", "x.js"));
const {getLlama} = await import(req.resolve("node-llama-cpp"));
const threads = Number(args.threads || 2);
const tokens = Number(args.tokens || 16);
const prompt = args["prompt-ids"].split(",").map(Number);

const llama = await getLlama({gpu: false, build: "never", maxThreads: threads, logLevel: "error"});
const model = await llama.loadModel({modelPath: args.model, gpuLayers: 0});
const context = await model.createContext({
  contextSize: Number(args.context || 1024), batchSize: Math.max(512, prompt.length), sequences: 1,
  threads: {ideal: threads, min: threads}, flashAttention: false});
const seq = context.getSequence();

let t = performance.now();
if (prompt.length > 1) await seq.evaluateWithoutGeneratingNewTokens(prompt.slice(0, -1));
const prefill_ms = performance.now() - t;
const out = [], step_ms = [];
t = performance.now();
for await (const token of seq.evaluate(prompt.slice(-1), {temperature: 0, yieldEogToken: true})) {
  const now = performance.now();
  step_ms.push(now - t);
  out.push(token);
  if (out.length >= tokens) break;
  t = now;
}
console.log(JSON.stringify({prefill_ms, prefill_tokens: prompt.length - 1, step_ms, tokens: out,
                            peak_rss_kb: process.resourceUsage().maxRSS, threads: context.currentThreads}));
await context.dispose();
await model.dispose();
