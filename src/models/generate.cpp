#include "dtp/models/generate.h"

#include "dtp/inference/engine.h"
#include "dtp/models/engine_model.h"

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

// Every rank of the model's mesh must hold the same tokens.
void checkAgree(Llama& model, const std::vector<std::vector<int64_t>>& out) {
  std::vector<int64_t> tokens;
  for (const auto& s : out) {
    tokens.push_back(static_cast<int64_t>(s.size()));
    tokens.insert(tokens.end(), s.begin(), s.end());
  }
  for (const auto& p : model->parameters()) {
    if (!is_dtensor(p)) continue;
    const DeviceMesh& mesh = device_mesh(p);
    for (int64_t d = 0; d < mesh.ndim(); ++d) {
      at::Tensor n = at::tensor({static_cast<int64_t>(tokens.size())}, at::kLong), n_hi = n.clone();
      mesh.get_group(d).all_reduce(n, ReduceOp::Min);
      mesh.get_group(d).all_reduce(n_hi, ReduceOp::Max);
      TORCH_CHECK(n.equal(n_hi), "generate: the ranks drew sequences of different lengths: their logits or generator "
                  "states differ. Seed every rank alike (GenerateOptions::seed).");
      at::Tensor lo = at::tensor(tokens, at::kLong), hi = lo.clone();
      mesh.get_group(d).all_reduce(lo, ReduceOp::Min);
      mesh.get_group(d).all_reduce(hi, ReduceOp::Max);
      TORCH_CHECK(lo.equal(hi), "generate: the ranks picked different tokens (min ", lo, ", max ", hi,
                  "): their logits or generator states differ. Seed every rank alike (GenerateOptions::seed).");
    }
    return;
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

std::vector<std::vector<int64_t>> generate(Llama& model, const std::vector<std::vector<int64_t>>& prompts,
                                           const GenerateOptions& o, GenerateStats* stats) {
  const int64_t batch = static_cast<int64_t>(prompts.size());
  TORCH_CHECK(batch > 0, "generate: no prompts.");
  TORCH_CHECK(o.max_new_tokens >= 1, "generate: max_new_tokens=", o.max_new_tokens, " must be at least 1.");
  int64_t longest = 0, total = 0;
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(!prompts[b].empty(), "generate: prompt ", b, " is empty. Give every prompt at least one token (e.g. BOS).");
    for (int64_t t : prompts[b]) {
      TORCH_CHECK(t >= 0 && t < model->config.vocab_size, "generate: prompt ", b, " holds token ", t,
                  ", outside the model's vocabulary of ", model->config.vocab_size, ".");
    }
    longest = std::max<int64_t>(longest, prompts[b].size());
    total += static_cast<int64_t>(prompts[b].size());
  }
  TORCH_CHECK(longest + o.max_new_tokens <= model->config.max_seq_len, "generate: the longest prompt (", longest,
              " tokens) plus max_new_tokens=", o.max_new_tokens, " is ", longest + o.max_new_tokens,
              " positions, but the model attends ", model->config.max_seq_len, " (max_seq_len). Shorten the prompt "
              "or lower max_new_tokens.");
  checkSameArguments(model, prompts, o);
  // See NOTE: [generate on the engine].
  inference::EngineOptions eo;
  eo.max_batch = eo.max_prefill = batch;
  eo.prefill_chunk = total;
  eo.context = longest + o.max_new_tokens;
  eo.max_queue = batch;
  inference::Engine engine(engine_model(model), eo);
  std::vector<std::vector<int64_t>> out(batch);
  for (int64_t b = 0; b < batch; ++b) {
    inference::RequestOptions ro;
    ro.sampling = o.sampling;
    ro.seed = o.seed + static_cast<uint64_t>(b);
    ro.max_tokens = o.max_new_tokens;
    ro.stop_tokens = o.stop_tokens;
    engine.enqueue(prompts[b], ro, [&out, b](const inference::Output& r) {
      out[b].insert(out[b].end(), r.tokens.begin(), r.tokens.end());
    });
  }
  for (bool first = true;; first = false) {
    const auto t0 = std::chrono::steady_clock::now();
    CommCounter comm;
    const bool more = engine.step();
    if (stats && first) stats->prefill_ms = msSince(t0);
    if (stats && !first) {
      stats->decode_ms.push_back(msSince(t0));
      stats->decode_collectives += comm.total_count();
      stats->decode_sequences += engine.metrics().running;  // the step's rows
    }
    if (!more) break;
  }
  if (o.check_ranks_agree || debugDetail()) checkAgree(model, out);
  return out;
}

// The deprecated form (dtp/models/generate.h), defined whatever this file's
// DTP_NO_DEPRECATED (dtp's own code is built with it, which hides the
// header's declaration): programs built without it call this. Declared here
// with the header's signature; DeprecatedApi.GenerateTakingAKvCache, built
// without DTP_NO_DEPRECATED, fails to link if the two drift apart.
std::vector<std::vector<int64_t>> generate(Llama& model, KVCache& cache, const std::vector<std::vector<int64_t>>& prompts,
                                           const GenerateOptions& o, GenerateStats* stats);

std::vector<std::vector<int64_t>> generate(Llama& model, KVCache& cache, const std::vector<std::vector<int64_t>>& prompts,
                                           const GenerateOptions& o, GenerateStats* stats) {
  int64_t longest = 0;
  for (const auto& p : prompts) longest = std::max<int64_t>(longest, p.size());
  TORCH_CHECK(longest + o.max_new_tokens - 1 <= cache.max_seq(), "generate: the longest prompt (", longest,
              " tokens) plus max_new_tokens=", o.max_new_tokens, " needs ", longest + o.max_new_tokens - 1,
              " cached positions, but the cache holds ", cache.max_seq(), " (max_seq). Build the KVCache with max_seq >= ",
              longest + o.max_new_tokens - 1, ", or shorten the prompt.");
  if (!prompts.empty()) cache.reset(static_cast<int64_t>(prompts.size()));  // its max_batch bounds the batch, as before
  return generate(model, prompts, o, stats);
}

}  // namespace dtp::models
