// The tokens that models::generate (dtp-generate's code path) draws for each
// prompt alone, to check dtp-serve against:
//   dtprun -n 2 greedy_reference HF_DIR CONTEXT CASES
// CASES holds one case a line: "max_new_tokens stop,ids,or,- prompt ids...",
// e.g. "24 - 84 104 101"; rank 0 prints "reference: <new token ids>" per case.
//   dtprun -n 1 greedy_reference HF_DIR CONTEXT CASES TOP_K [float64]
// also prints, per case, "logprobs: [[token, logprob, [[id, logprob] x TOP_K]]
// per new token]": at::log_softmax of one device's forward logits over the
// whole sequence (prompt and new tokens, no KV cache, no engine), in float64,
// at each new token, and its TOP_K best tokens (logprob descending, lower id
// first at equal logprobs), for dtp-serve's logprobs (serve_features_test.mjs).
// With float64 the model runs in float64 (dtp-serve --dtype float64).
#include "dtp/dtensor.h"
#include "dtp/models/generate.h"
#include "dtp/models/hf_llama.h"
#include "dtp/models/llama.h"

#include <ATen/ATen.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

namespace {

// See the usage above: one line "logprobs: [...]" for the new tokens `drawn`.
void printLogprobs(dtp::models::Llama& model, const std::vector<int64_t>& prompt, const std::vector<int64_t>& drawn,
                   int64_t top_k) {
  std::vector<int64_t> ids = prompt;
  ids.insert(ids.end(), drawn.begin(), drawn.end());
  at::Tensor logits;
  {
    at::NoGradGuard no_grad;
    logits = model->forward(at::tensor(ids, at::kLong).unsqueeze(0));
  }
  const at::Tensor lsm = at::log_softmax(logits.to(at::kDouble)[0], -1);  // [T, V]
  std::string line = "logprobs: [";
  char buf[64];
  for (size_t j = 0; j < drawn.size(); ++j) {
    const at::Tensor row = lsm[static_cast<int64_t>(prompt.size() + j) - 1];
    // Stable descending: equal logprobs keep the lower id first.
    const auto sorted = at::sort(row, /*stable=*/true, /*dim=*/0, /*descending=*/true);
    const at::Tensor values = std::get<0>(sorted), order = std::get<1>(sorted);
    std::snprintf(buf, sizeof buf, "%.17g", row[drawn[j]].item<double>());
    line += (j ? ", [" : "[") + std::to_string(drawn[j]) + ", " + buf + ", [";
    for (int64_t i = 0; i < std::min<int64_t>(top_k, row.size(0)); ++i) {
      std::snprintf(buf, sizeof buf, "%.17g", values[i].item<double>());
      line += (i ? ", [" : "[") + std::to_string(order[i].item<int64_t>()) + ", " + buf + "]";
    }
    line += "]]";
  }
  std::cout << line << "]" << std::endl;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace dtp;
  using namespace dtp::models;
  if (argc < 4 || argc > 6 || (argc == 6 && std::string(argv[5]) != "float64")) {
    std::cerr << "usage: greedy_reference HF_DIR CONTEXT CASES [TOP_K [float64]]\n";
    return 2;
  }
  try {
    ProcessGroup world = init_process_group();
    LlamaConfig config = llama_config_from_hf(argv[1], std::stoll(argv[2]));
    const int64_t top_k = argc >= 5 ? std::stoll(argv[4]) : -1;
    if (argc == 6) config.dtype = c10::ScalarType::Double;
    TORCH_CHECK(top_k < 0 || world.size() == 1, "greedy_reference: ranks for TOP_K: got ", world.size(),
                ", expected 1 (the logprobs reference is one device's). Run it with dtprun -n 1.");
    DeviceMesh mesh = init_device_mesh("cpu", {world.size()}, {"tp"});
    Llama model(config);
    if (world.size() > 1) apply_tensor_parallel_for_inference(model, mesh);
    load_hf_weights(model, argv[1]);
    model->eval();
    std::ifstream in(argv[3]);
    TORCH_CHECK(in.good(), "greedy_reference: cannot read ", argv[3], ".");
    for (std::string line; std::getline(in, line);) {
      if (line.empty()) continue;
      std::istringstream words(line);
      GenerateOptions o;
      std::string stops;
      words >> o.max_new_tokens >> stops;
      std::istringstream stop_words(stops);
      for (std::string s; std::getline(stop_words, s, ',');) {
        if (s != "-") o.stop_tokens.push_back(std::stoll(s));
      }
      std::vector<int64_t> prompt;
      for (int64_t t; words >> t;) prompt.push_back(t);
      const auto out = generate(model, {prompt}, o);
      if (world.rank() == 0) {
        std::cout << "reference:";
        for (int64_t t : out[0]) std::cout << " " << t;
        std::cout << std::endl;
      }
      if (top_k >= 0) printLogprobs(model, prompt, out[0], top_k);
    }
  } catch (const c10::Error& e) {
    std::cerr << "greedy_reference: " << e.what_without_backtrace() << "\n";
    return 1;
  }
  return 0;
}
