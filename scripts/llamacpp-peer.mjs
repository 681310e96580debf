// llama.cpp's side of scripts/cpu-vs-llamacpp: node-llama-cpp's prebuilt CPU build (no
// compiler, no GPU), on the same GGUF, prompt token ids and threads as Ferry.
//   node llamacpp-peer.mjs tokenize MODEL N          -> N prompt token ids (JSON)
//   node llamacpp-peer.mjs run MODEL IDS_FILE DECODE THREADS
//        -> {"prefill_tokens_per_s", "decode_tokens_per_s", "token_ids"}: the prompt, then
//           DECODE greedy tokens; prefill = prompt / time to the first token, decode = the
//           other DECODE - 1 tokens / their time (Ferry's `generate --json` definitions).
import { readFileSync } from "node:fs";
import { getLlama } from "node-llama-cpp";

const [cmd, modelPath, a, b, c] = process.argv.slice(2);
const llama = await getLlama({ gpu: false, build: "never", logLevel: "error" });
const model = await llama.loadModel({ modelPath });
if (cmd === "tokenize") {
  const text = "Ferry moves KV pages between machines, chunk after chunk, while the router keeps track " +
    "of which prefill node holds which prefix. The quick brown fox jumps over the lazy dog near the river. ";
  const ids = model.tokenize(text.repeat(Math.ceil(Number(a) / 30) + 1));
  console.log(JSON.stringify(ids.slice(0, Number(a))));
} else if (cmd === "run") {
  const ids = JSON.parse(readFileSync(a, "utf8"));
  const decode = Number(b);
  const threads = Number(c);
  const context = await model.createContext({ contextSize: ids.length + decode + 16, threads, batchSize: 512 });
  const seq = context.getSequence();
  const out = [];
  const t0 = performance.now();
  let t1 = 0;
  for await (const tok of seq.evaluate(ids, { temperature: 0 })) {
    if (out.length === 0) t1 = performance.now();
    out.push(tok);
    if (out.length === decode) break;
  }
  const t2 = performance.now();
  console.log(JSON.stringify({
    prefill_tokens_per_s: ids.length / ((t1 - t0) / 1e3),
    decode_tokens_per_s: (out.length - 1) / ((t2 - t1) / 1e3),
    token_ids: out,
  }));
  await context.dispose();
} else {
  throw new Error(`unknown command ${cmd}`);
}
await model.dispose();
await llama.dispose();
