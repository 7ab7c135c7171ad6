#include "dtp/dcp/state_dict.h"

#include "comm/compat.h"
#include "dtp/dtensor.h"
#include "dtp/module_utils.h"

#include <ATen/ATen.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <nlohmann/json.hpp>

#include <set>
#include <unordered_map>

namespace dtp::dcp {
namespace {

using Json = nlohmann::json;

constexpr const char* kStatePrefix = "optimizer.state.";
constexpr const char* kGroupsKey = "optimizer.param_groups";
constexpr const char* kKindKey = "optimizer.kind";

std::unordered_map<const c10::TensorImpl*, std::string> namesOf(torch::nn::Module& model) {
  std::unordered_map<const c10::TensorImpl*, std::string> names;
  for (const auto& [name, p] : unique_named_parameters(model)) names.emplace(p.unsafeGetTensorImpl(), name);
  return names;
}

enum class Kind { AdamW, Adam, SGD };

Kind kindOf(torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<torch::optim::AdamW*>(&optimizer)) return Kind::AdamW;
  if (dynamic_cast<torch::optim::Adam*>(&optimizer)) return Kind::Adam;
  if (dynamic_cast<torch::optim::SGD*>(&optimizer)) return Kind::SGD;
  TORCH_CHECK(false, "dtp checkpoints: NYI: this optimizer type (", typeid(optimizer).name(),
              "). Supported: torch::optim::AdamW (and dtp::optim::AdamW), Adam, SGD.");
}

const char* kindName(Kind k) { return k == Kind::AdamW ? "AdamW" : k == Kind::Adam ? "Adam" : "SGD"; }

// Calls f(fqn, param) for every parameter the optimizer holds.
template <class F>
void forEachParam(torch::nn::Module& model, torch::optim::Optimizer& optimizer, F f) {
  const auto names = namesOf(model);
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      auto it = names.find(p.unsafeGetTensorImpl());
      TORCH_CHECK(it != names.end(), "dtp checkpoints: the optimizer holds a parameter of shape ", p.sizes(),
                  " that the module does not have. Build the optimizer from this module's parameters.");
      f(it->second, p);
    }
  }
}

// The state tensors of one parameter under `kind`, by field name.
template <class State>
std::vector<std::pair<std::string, at::Tensor>> adamFields(State& s) {
  std::vector<std::pair<std::string, at::Tensor>> f{{"exp_avg", s.exp_avg()}, {"exp_avg_sq", s.exp_avg_sq()}};
  if (s.max_exp_avg_sq().defined()) f.emplace_back("max_exp_avg_sq", s.max_exp_avg_sq());
  return f;
}

Json groupOptions(Kind kind, torch::optim::OptimizerParamGroup& g) {
  if (kind == Kind::SGD) {
    auto& o = static_cast<torch::optim::SGDOptions&>(g.options());
    return {{"lr", o.lr()}, {"momentum", o.momentum()}, {"dampening", o.dampening()},
            {"weight_decay", o.weight_decay()}, {"nesterov", o.nesterov()}};
  }
  auto write = [](auto& o) {
    return Json{{"lr", o.lr()}, {"betas", {std::get<0>(o.betas()), std::get<1>(o.betas())}}, {"eps", o.eps()},
                {"weight_decay", o.weight_decay()}, {"amsgrad", o.amsgrad()}};
  };
  if (kind == Kind::AdamW) return write(static_cast<torch::optim::AdamWOptions&>(g.options()));
  return write(static_cast<torch::optim::AdamOptions&>(g.options()));
}

void setGroupOptions(Kind kind, torch::optim::OptimizerParamGroup& g, const Json& j) {
  if (kind == Kind::SGD) {
    auto& o = static_cast<torch::optim::SGDOptions&>(g.options());
    o.lr(j.at("lr")).momentum(j.at("momentum")).dampening(j.at("dampening"));
    o.weight_decay(j.at("weight_decay")).nesterov(j.at("nesterov"));
    return;
  }
  auto read = [&](auto& o) {
    o.lr(j.at("lr")).eps(j.at("eps")).weight_decay(j.at("weight_decay")).amsgrad(j.at("amsgrad"));
    o.betas(std::make_tuple(j.at("betas").at(0).get<double>(), j.at("betas").at(1).get<double>()));
  };
  if (kind == Kind::AdamW) read(static_cast<torch::optim::AdamWOptions&>(g.options()));
  else read(static_cast<torch::optim::AdamOptions&>(g.options()));
}

bool amsgrad(Kind kind, torch::optim::OptimizerParamGroup& g) {
  if (kind == Kind::AdamW) return static_cast<torch::optim::AdamWOptions&>(g.options()).amsgrad();
  if (kind == Kind::Adam) return static_cast<torch::optim::AdamOptions&>(g.options()).amsgrad();
  return false;
}

}  // namespace

const at::Tensor* StateDict::find(const std::string& name) const {
  for (const auto& [n, t] : tensors) {
    if (n == name) return &t;
  }
  return nullptr;
}

StateDict get_model_state_dict(torch::nn::Module& model, const StateDictOptions& options) {
  StateDict sd;
  std::vector<std::string> all;  // for the error of a keep that accepts nothing
  for (auto& [name, p] : unique_named_parameters(model)) {
    all.push_back(name);
    if (!options.keep || options.keep(name)) sd.add("model." + name, p);
  }
  for (const auto& item : model.named_buffers()) {
    all.push_back(item.key());
    if (options.keep && !options.keep(item.key())) continue;
    const auto dot = item.key().rfind('.');
    const std::string last = dot == std::string::npos ? item.key() : item.key().substr(dot + 1);
    const auto& skip = options.non_persistent_buffers;
    if (std::find(skip.begin(), skip.end(), last) == skip.end()) sd.add("model." + item.key(), item.value());
  }
  TORCH_CHECK(!options.keep || all.empty() || !sd.tensors.empty(), "get_model_state_dict: "
              "StateDictOptions::keep accepts none of the module's ", all.size(), " parameters and buffers (such as '",
              all.front(), "'), so nothing would be saved or loaded. Check the FQNs it tests (a misspelt prefix?).");
  return sd;
}

StateDict get_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer) {
  const Kind kind = kindOf(optimizer);
  StateDict sd;
  auto& state = optimizer.state();
  forEachParam(model, optimizer, [&](const std::string& fqn, const at::Tensor& p) {
    auto it = state.find(compat::optimizer_state_key(p));
    if (it == state.end()) return;  // no step taken yet
    const std::string prefix = kStatePrefix + fqn + ".";
    if (kind == Kind::SGD) {
      auto& s = static_cast<torch::optim::SGDParamState&>(*it->second);
      if (s.momentum_buffer().defined()) sd.add(prefix + "momentum_buffer", s.momentum_buffer());
      return;
    }
    int64_t step = 0;
    std::vector<std::pair<std::string, at::Tensor>> fields;
    if (kind == Kind::AdamW) {
      auto& s = static_cast<torch::optim::AdamWParamState&>(*it->second);
      fields = adamFields(s);
      step = s.step();
    } else {
      auto& s = static_cast<torch::optim::AdamParamState&>(*it->second);
      fields = adamFields(s);
      step = s.step();
    }
    for (auto& [field, t] : fields) sd.add(prefix + field, t);
    sd.add(prefix + "step", at::scalar_tensor(step, at::kLong));
  });
  Json groups = Json::array();
  for (auto& g : optimizer.param_groups()) groups.push_back(groupOptions(kind, g));
  sd.metadata[kGroupsKey] = groups.dump();
  sd.metadata[kKindKey] = kindName(kind);
  return sd;
}

StateDict get_state_dict(torch::nn::Module& model, torch::optim::Optimizer* optimizer,
                         const StateDictOptions& options) {
  StateDict sd = get_model_state_dict(model, options);
  if (!optimizer) return sd;
  StateDict osd = get_optimizer_state_dict(model, *optimizer);
  for (auto& e : osd.tensors) sd.tensors.push_back(std::move(e));
  for (auto& [k, v] : osd.metadata) sd.metadata[k] = std::move(v);
  return sd;
}

void init_optimizer_state(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                          const std::vector<std::string>& fqns) {
  const Kind kind = kindOf(optimizer);
  const std::set<std::string> with_state(fqns.begin(), fqns.end());
  auto& state = optimizer.state();
  torch::NoGradGuard no_grad;
  for (auto& group : optimizer.param_groups()) {
    const bool ams = amsgrad(kind, group);
    const bool momentum = kind == Kind::SGD && static_cast<torch::optim::SGDOptions&>(group.options()).momentum() != 0;
    forEachParam(model, optimizer, [&](const std::string& fqn, const at::Tensor& p) {
      bool mine = false;
      for (const auto& q : group.params()) mine |= q.is_same(p);
      if (!mine) return;
      const auto key = compat::optimizer_state_key(p);
      state.erase(key);
      if (!with_state.count(fqn)) return;
      auto zeros = [&] { return at::zeros_like(p.detach()); };
      if (kind == Kind::SGD) {
        auto s = std::make_unique<torch::optim::SGDParamState>();
        if (momentum) s->momentum_buffer(zeros());
        state[key] = std::move(s);
      } else if (kind == Kind::AdamW) {
        auto s = std::make_unique<torch::optim::AdamWParamState>();
        s->exp_avg(zeros()).exp_avg_sq(zeros());
        if (ams) s->max_exp_avg_sq(zeros());
        state[key] = std::move(s);
      } else {
        auto s = std::make_unique<torch::optim::AdamParamState>();
        s->exp_avg(zeros()).exp_avg_sq(zeros());
        if (ams) s->max_exp_avg_sq(zeros());
        state[key] = std::move(s);
      }
    });
  }
}

void check_optimizer_metadata(torch::optim::Optimizer& optimizer, const std::map<std::string, std::string>& metadata) {
  const Kind kind = kindOf(optimizer);
  auto kindIt = metadata.find(kKindKey);
  TORCH_CHECK(kindIt != metadata.end() && kindIt->second == kindName(kind), "load_state: the checkpoint holds ",
              kindIt == metadata.end() ? std::string("no optimizer") : kindIt->second + " state",
              ", but the optimizer given is ", kindName(kind),
              ". Pass the optimizer type that saved it, or no optimizer to load the model alone.");
  auto groupsIt = metadata.find(kGroupsKey);
  TORCH_CHECK(groupsIt != metadata.end(), "load_state: the checkpoint has ", kindName(kind), " state but no \"",
              kGroupsKey, "\" metadata (the optimizer's learning rates and other options), which every dtp save "
              "writes. The checkpoint is corrupt; load the previous one.");
  Json groups;
  try {
    groups = Json::parse(groupsIt->second);
  } catch (const Json::exception& e) {
    TORCH_CHECK(false, "load_state: the checkpoint's \"", kGroupsKey, "\" is not valid JSON (", e.what(),
                "). The checkpoint is corrupt; load the previous one.");
  }
  TORCH_CHECK(groups.is_array() && groups.size() == optimizer.param_groups().size(), "load_state: the checkpoint's "
              "optimizer has ", groups.is_array() ? groups.size() : 0, " param groups, this one ",
              optimizer.param_groups().size(), ". Build the optimizer with the same param groups as the run that "
              "saved it.");
}

void set_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer, const StateDict& sd) {
  check_optimizer_metadata(optimizer, sd.metadata);
  const Kind kind = kindOf(optimizer);
  auto& state = optimizer.state();
  forEachParam(model, optimizer, [&](const std::string& fqn, const at::Tensor& p) {
    const at::Tensor* step = sd.find(kStatePrefix + fqn + ".step");
    auto it = state.find(compat::optimizer_state_key(p));
    if (step == nullptr || it == state.end()) return;
    if (kind == Kind::AdamW) static_cast<torch::optim::AdamWParamState&>(*it->second).step(step->item<int64_t>());
    if (kind == Kind::Adam) static_cast<torch::optim::AdamParamState&>(*it->second).step(step->item<int64_t>());
  });
  const Json groups = Json::parse(sd.metadata.at(kGroupsKey));
  for (size_t i = 0; i < groups.size(); ++i) setGroupOptions(kind, optimizer.param_groups()[i], groups[i]);
}

}  // namespace dtp::dcp
