// save_state / load_state: a module and its optimizer in one checkpoint.
#include "dtp/dcp/checkpoint.h"

#include "dcp/load_index.h"

#include <set>

namespace dtp::dcp {
namespace {

constexpr const char* kOptimizerPrefix = "optimizer.";
constexpr const char* kStatePrefix = "optimizer.state.";
constexpr const char* kModelPrefix = "model.";

}  // namespace

void save_state(const std::string& dir, torch::nn::Module& model, torch::optim::Optimizer* optimizer,
                const std::map<std::string, std::string>& metadata, const StateDictOptions& sd_options,
                const SaveOptions& options) {
  StateDict sd = get_state_dict(model, optimizer, sd_options);
  for (const auto& [k, v] : metadata) {
    TORCH_CHECK(k.rfind(kOptimizerPrefix, 0) != 0, "save_state: metadata key '", k,
                "' starts with \"optimizer.\", which is reserved for the optimizer's options. Rename it.");
    sd.metadata[k] = v;
  }
  save(sd, dir, options);
}

std::map<std::string, std::string> load_state(const std::string& dir, torch::nn::Module& model,
                                              torch::optim::Optimizer* optimizer, const StateDictOptions& sd_options,
                                              LoadOptions options) {
  StateDict sd = get_model_state_dict(model, sd_options);
  std::optional<io::CheckpointIndex> read;
  if (sd_options.keep) {  // the entries of parameters not kept are other ranks' to load
    read = read_index(dir);
    for (const auto& [name, t] : read->tensors) {
      const bool of_model = name.rfind(kModelPrefix, 0) == 0, of_state = name.rfind(kStatePrefix, 0) == 0;
      const std::string fqn = of_model ? name.substr(std::string(kModelPrefix).size())
                              : of_state ? name.substr(std::string(kStatePrefix).size(),
                                                       name.rfind('.') - std::string(kStatePrefix).size())
                                         : "";
      if ((of_model || of_state) && !sd_options.keep(fqn)) options.ignore_prefixes.push_back(name);
    }
  }
  if (!optimizer) {
    options.ignore_prefixes.push_back(kOptimizerPrefix);
    return load_with_index(sd, dir, std::move(read), options);
  }
  // The parameters that had optimizer state when saved get fresh state to
  // load into; the others (no step yet) get none. A load that fails leaves
  // the optimizer as it was: its state is set aside and put back on error.
  if (!read) read = read_index(dir);
  check_optimizer_metadata(*optimizer, read->metadata);
  std::set<std::string> fqns;
  for (const auto& [name, t] : read->tensors) {
    if (name.rfind(kStatePrefix, 0) != 0) continue;
    const std::string rest = name.substr(std::string(kStatePrefix).size());
    fqns.insert(rest.substr(0, rest.rfind('.')));
  }
  auto previous = std::move(optimizer->state());
  optimizer->state().clear();
  try {
    init_optimizer_state(model, *optimizer, {fqns.begin(), fqns.end()});
    StateDict osd = get_optimizer_state_dict(model, *optimizer);
    for (const auto& e : osd.tensors) sd.tensors.push_back(e);  // the same tensors: filled in place
    osd.metadata = load_with_index(sd, dir, std::move(read), options);
    set_optimizer_state_dict(model, *optimizer, osd);
    return osd.metadata;
  } catch (...) {
    optimizer->state() = std::move(previous);
    throw;
  }
}

}  // namespace dtp::dcp
