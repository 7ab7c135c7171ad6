// The tokens that models::generate (dtp-generate's code path) draws for each
// prompt alone, to check dtp-serve against:
//   dtprun -n 2 greedy_reference HF_DIR CONTEXT CASES
// CASES holds one case a line: "max_new_tokens stop,ids,or,- prompt ids...",
// e.g. "24 - 84 104 101"; rank 0 prints "reference: <new token ids>" per case.
#include "dtp/dtensor.h"
#include "dtp/models/generate.h"
#include "dtp/models/hf_llama.h"
#include "dtp/models/llama.h"

#include <fstream>
#include <iostream>
#include <sstream>

int main(int argc, char** argv) {
  using namespace dtp;
  using namespace dtp::models;
  if (argc != 4) {
    std::cerr << "usage: greedy_reference HF_DIR CONTEXT CASES\n";
    return 2;
  }
  try {
    ProcessGroup world = init_process_group();
    LlamaConfig config = llama_config_from_hf(argv[1], std::stoll(argv[2]));
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
      KVCache cache(1, static_cast<int64_t>(prompt.size()) + o.max_new_tokens);
      const auto out = generate(model, cache, {prompt}, o);
      if (world.rank() == 0) {
        std::cout << "reference:";
        for (int64_t t : out[0]) std::cout << " " << t;
        std::cout << std::endl;
      }
    }
  } catch (const c10::Error& e) {
    std::cerr << "greedy_reference: " << e.what_without_backtrace() << "\n";
    return 1;
  }
  return 0;
}
