// A C++ service embedding the serving engine, without HTTP: a tiny random
// Llama with tensor parallelism over the ranks, requests from two threads,
// text streamed by callback, one request cancelled; its greedy tokens are
// checked against models::generate's. Run: dtprun -n 2 engine_embed (dtprun
// prefixes each line with its rank)
#include <dtp/device_mesh.h>
#include <dtp/inference/engine.h>
#include <dtp/models/engine_model.h>
#include <dtp/models/generate.h>
#include <dtp/models/parallelize.h>
#include <dtp/text/tokenizer.h>

#include <atomic>
#include <chrono>
#include <iostream>
#include <mutex>
#include <thread>

using namespace dtp;

int main() {
  ProcessGroup world = init_process_group();
  models::LlamaConfig c;  // random weights, the same on every rank (seeded)
  c.vocab_size = 256, c.dim = 32, c.n_layers = 2, c.n_heads = 4, c.n_kv_heads = 2, c.ffn_hidden = 64, c.max_seq_len = 64;
  c.dtype = at::kDouble;
  models::Llama model(c);
  models::apply_tensor_parallel_for_inference(model, init_device_mesh("cpu", {world.size()}, {"tp"}));
  models::ByteTokenizer tok;
  std::vector<std::vector<int64_t>> prompts;
  for (const char* s : {"Hello, engine", "dtp serves", "tensor parallel", "cancel me"}) prompts.push_back(tok.encode(s, false));
  models::GenerateOptions go;  // the reference, greedy; collective: before the engine, on every rank
  go.max_new_tokens = 12;
  const auto want = models::generate(model, {prompts[0], prompts[1], prompts[2]}, go);

  inference::Engine engine(models::engine_model(model), inference::EngineOptions(), world, &tok);
  if (world.rank() != 0) return engine.follow();  // runs the leader's steps until it stops
  std::mutex mu;
  std::vector<std::vector<int64_t>> got(prompts.size());
  size_t done = 0;
  auto submit = [&](size_t i) {
    inference::RequestOptions ro;
    ro.max_tokens = go.max_new_tokens;
    return engine.enqueue(prompts[i], ro, [&, i](const inference::Output& o) {  // on the serving thread
      std::lock_guard<std::mutex> lk(mu);
      got[i].insert(got[i].end(), o.tokens.begin(), o.tokens.end());
      std::string text;
      for (unsigned char ch : o.text) text += ch >= 32 && ch < 127 ? static_cast<char>(ch) : '.';  // random bytes
      std::cout << "request " << i << " +" << o.tokens.size() << " tokens '" << text << "'";
      if (o.finished) std::cout << " finished (" << inference::finish_reason_name(o.finish_reason) << "), usage "
                                << o.prompt_tokens << " prompt + " << o.completion_tokens << " completion tokens";
      std::cout << std::endl;
      done += o.finished;
    });
  };
  std::atomic<bool> stop{false};
  std::thread server([&] { engine.serve(stop); });
  std::thread a([&] { submit(0); submit(1); });
  std::thread b([&] { submit(2); engine.cancel(submit(3).id); });
  a.join(), b.join();
  while (true) {  // a service would wait on its own clients instead
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    std::lock_guard<std::mutex> lk(mu);
    if (done == prompts.size()) break;
  }
  stop = true;  // waiting requests fail, the followers are told to exit
  server.join();
  const inference::EngineMetrics m = engine.metrics();
  std::cout << "metrics: " << m.requests << " requests, " << m.finished << " finished, " << m.cancelled
            << " cancelled, " << m.generation_tokens << " tokens in " << m.steps << " steps" << std::endl;
  const bool same = std::vector<std::vector<int64_t>>(got.begin(), got.begin() + 3) == want;
  std::cout << "greedy tokens of 3 prompts at tp " << world.size() << ": "
            << (same ? "matches generate" : "DIFFERS from generate") << std::endl;
  return same ? 0 : 1;
}
