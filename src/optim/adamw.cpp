#include "dtp/optim/adamw.h"

#include "comm/compat.h"
#include "dtensor/dtensor_impl.h"

namespace dtp::optim {
namespace {

// The shard of `t` when it is a DTensor with the spec `spec`; else undefined.
at::Tensor shardWithSpec(const at::Tensor& t, const DTensorSpec& spec) {
  auto* impl = maybeGetDTensorImpl(t);
  if (impl == nullptr || !(impl->spec_ptr().get() == &spec || impl->spec() == spec)) return {};
  return impl->local();
}

// A parameter handed to libtorch's step as its shard's alias.
struct Swapped {
  at::Tensor* slot;  // in its param group
  at::Tensor param;
  at::Tensor alias;
  bool had_state;
};

}  // namespace

torch::Tensor AdamW::step(LossClosure closure) {
  torch::Tensor loss;
  if (closure != nullptr) {  // gradients first: the aliases take them below
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  auto& states = state();
  std::vector<Swapped> swapped;
  for (auto& group : param_groups()) {
    for (at::Tensor& p : group.params()) {
      auto* impl = maybeGetDTensorImpl(p);
      if (impl == nullptr || !p.grad().defined()) continue;
      const DTensorSpec& spec = impl->spec();
      at::Tensor grad = shardWithSpec(p.grad(), spec);
      if (!grad.defined()) continue;
      auto it = states.find(compat::optimizer_state_key(p));
      std::unique_ptr<torch::optim::AdamWParamState> local_state;
      if (it != states.end()) {
        const auto& s = static_cast<const torch::optim::AdamWParamState&>(*it->second);
        local_state = std::make_unique<torch::optim::AdamWParamState>();
        local_state->step(s.step());
        local_state->exp_avg(shardWithSpec(s.exp_avg(), spec));
        local_state->exp_avg_sq(shardWithSpec(s.exp_avg_sq(), spec));
        if (s.max_exp_avg_sq().defined()) local_state->max_exp_avg_sq(shardWithSpec(s.max_exp_avg_sq(), spec));
        if (!local_state->exp_avg().defined() || !local_state->exp_avg_sq().defined() ||
            (s.max_exp_avg_sq().defined() && !local_state->max_exp_avg_sq().defined()))
          continue;
      }
      Swapped sw{&p, p, detached_alias(impl->local()), local_state != nullptr};
      sw.alias.mutable_grad() = grad;
      if (local_state) states[compat::optimizer_state_key(sw.alias)] = std::move(local_state);
      p = sw.alias;
      swapped.push_back(std::move(sw));
    }
  }
  // Parameters and state go back whatever happens in libtorch's step.
  auto restore = [&] {
    for (Swapped& sw : swapped) {
      *sw.slot = sw.param;
      sw.param.unsafeGetTensorImpl()->bump_version();
      auto it = states.find(compat::optimizer_state_key(sw.alias));
      if (it == states.end()) continue;  // libtorch's step failed before making it
      const std::unique_ptr<torch::optim::OptimizerParamState> node = std::move(it->second);
      states.erase(it);
      auto& local = static_cast<torch::optim::AdamWParamState&>(*node);
      const auto key = compat::optimizer_state_key(sw.param);
      if (sw.had_state) {
        static_cast<torch::optim::AdamWParamState&>(*states.at(key)).step(local.step());
        continue;
      }
      const SpecPtr& spec = unsafeGetDTensorImpl(sw.param)->spec_ptr();
      auto state = std::make_unique<torch::optim::AdamWParamState>();
      state->step(local.step());
      state->exp_avg(makeDTensor(local.exp_avg(), spec));
      state->exp_avg_sq(makeDTensor(local.exp_avg_sq(), spec));
      if (local.max_exp_avg_sq().defined()) state->max_exp_avg_sq(makeDTensor(local.max_exp_avg_sq(), spec));
      states[key] = std::move(state);
    }
  };
  try {
    torch::optim::AdamW::step();
  } catch (...) {
    restore();
    throw;
  }
  restore();
  return loss;
}

}  // namespace dtp::optim
