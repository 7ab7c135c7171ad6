#include "dtp/models/generate.h"

#include "dtp/comm_counter.h"
#include "dtp/dtensor.h"
#include "dtp/models/parallelize.h"
#include "models/agree_on_mesh.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>

namespace dtp::models {
namespace {

double msSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

bool debugDetail() {
  const char* v = std::getenv("TORCH_DISTRIBUTED_DEBUG");
  return v != nullptr && std::strcmp(v, "DETAIL") == 0;
}

// Every rank of the logits' group must hold the same tokens.
void checkAgree(const at::Tensor& logits, const std::vector<int64_t>& tokens) {
  if (!is_dtensor(logits)) return;
  const DeviceMesh& mesh = device_mesh(logits);
  for (int64_t d = 0; d < mesh.ndim(); ++d) {
    at::Tensor lo = at::tensor(tokens, at::kLong), hi = lo.clone();
    mesh.get_group(d).all_reduce(lo, ReduceOp::Min);
    mesh.get_group(d).all_reduce(hi, ReduceOp::Max);
    TORCH_CHECK(lo.equal(hi), "generate: the ranks picked different tokens (min ", lo, ", max ", hi,
                "): their logits or generator states differ. Seed every rank alike (GenerateOptions::seed).");
  }
}

// Ranks that pass other prompts of the same length, or other options, would
// run the same collectives and return tokens that match neither prompt.
void checkSameArguments(Llama& model, const std::vector<std::vector<int64_t>>& prompts, const GenerateOptions& o) {
  std::string prompt_text;
  for (const auto& p : prompts) prompt_text += c10::str(c10::IntArrayRef(p));
  agree_on_mesh(*model, "generate", "prompts (token ids)", prompt_text);
  agree_on_mesh(*model, "generate", "options",
                c10::str("max_new_tokens=", o.max_new_tokens, " temperature=", o.sampling.temperature, " top_k=",
                         o.sampling.top_k, " top_p=", o.sampling.top_p, " seed=", o.seed, " stop_tokens=",
                         c10::IntArrayRef(o.stop_tokens)));
}

}  // namespace

void apply_tensor_parallel_for_inference(Llama& model, const DeviceMesh& mesh) {
  TensorParallelOptions o;
  o.sequence_parallel = false;
  o.replicate_kv_heads = true;
  apply_tensor_parallel(model, mesh, o);
}

std::vector<std::vector<int64_t>> generate(Llama& model, KVCache& cache, const std::vector<std::vector<int64_t>>& prompts,
                                           const GenerateOptions& o, GenerateStats* stats) {
  const int64_t batch = static_cast<int64_t>(prompts.size());
  TORCH_CHECK(batch > 0, "generate: no prompts.");
  TORCH_CHECK(o.max_new_tokens >= 1, "generate: max_new_tokens=", o.max_new_tokens, " must be at least 1.");
  int64_t longest = 0;
  std::vector<int64_t> lengths;
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(!prompts[b].empty(), "generate: prompt ", b, " is empty. Give every prompt at least one token (e.g. BOS).");
    for (int64_t t : prompts[b]) {
      TORCH_CHECK(t >= 0 && t < model->config.vocab_size, "generate: prompt ", b, " holds token ", t,
                  ", outside the model's vocabulary of ", model->config.vocab_size, ".");
    }
    lengths.push_back(static_cast<int64_t>(prompts[b].size()));
    longest = std::max(longest, lengths.back());
  }
  TORCH_CHECK(longest + o.max_new_tokens - 1 <= cache.max_seq(), "generate: the longest prompt (", longest,
              " tokens) plus max_new_tokens=", o.max_new_tokens, " needs ", longest + o.max_new_tokens - 1,
              " cached positions, but the cache holds ", cache.max_seq(), " (max_seq). Build the KVCache with max_seq >= ",
              longest + o.max_new_tokens - 1, ", or shorten the prompt.");
  checkSameArguments(model, prompts, o);
  cache.reset(batch);
  torch::NoGradGuard no_grad;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(o.seed);
  const bool check = o.check_ranks_agree || debugDetail();
  const auto device = model->config.device;

  // Prefill: the prompts right-padded into one [B, longest] batch.
  at::Tensor tokens = at::zeros({batch, longest}, at::kLong);
  for (int64_t b = 0; b < batch; ++b) {
    tokens[b].narrow(0, 0, lengths[b]).copy_(at::tensor(prompts[b], at::kLong));
  }
  auto t0 = std::chrono::steady_clock::now();
  at::Tensor logits = model->forward(tokens.to(device), cache, lengths);
  std::vector<int64_t> next = inference::sample(logits, o.sampling, gen);
  if (check) checkAgree(logits, next);
  if (stats) stats->prefill_ms = msSince(t0);

  std::vector<std::vector<int64_t>> out(batch);
  std::vector<int64_t> active(batch);  // the sequences still generating, in cache order
  for (int64_t b = 0; b < batch; ++b) active[b] = b;
  while (true) {
    std::vector<int64_t> rows, still, tokens;  // the cache rows, sequences and tokens that go on
    for (size_t i = 0; i < active.size(); ++i) {
      std::vector<int64_t>& seq = out[active[i]];
      seq.push_back(next[i]);
      const bool done = std::find(o.stop_tokens.begin(), o.stop_tokens.end(), next[i]) != o.stop_tokens.end() ||
                        static_cast<int64_t>(seq.size()) == o.max_new_tokens;
      if (done) continue;
      rows.push_back(static_cast<int64_t>(i));
      still.push_back(active[i]);
      tokens.push_back(next[i]);
    }
    if (still.empty()) break;
    if (still.size() < active.size()) cache.keep(rows);  // every rank drops the same rows: the tokens agree
    active = std::move(still);
    const int64_t n = static_cast<int64_t>(active.size());
    t0 = std::chrono::steady_clock::now();
    CommCounter comm;
    logits = model->forward(at::tensor(tokens, at::kLong).view({n, 1}).to(device), cache, std::vector<int64_t>(n, 1));
    next = inference::sample(logits, o.sampling, gen);
    if (check) checkAgree(logits, next);
    if (stats) {
      stats->decode_ms.push_back(msSince(t0));
      stats->decode_collectives += comm.total_count();
      stats->decode_sequences += n;
    }
  }
  return out;
}

}  // namespace dtp::models
