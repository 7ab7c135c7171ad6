// Forward hooks for libtorch modules. libtorch's ModuleHolder calls
// impl->forward directly and nn::Module has no hooks, so dtp ships a drop-in
// holder: dtp::nn::Hooked<Impl> holds HookedImpl<Impl>, which *is* the stock
// Impl (fields, forward, parameters) plus a HookHost that parallelize_module
// and distribute_module fill. A user changes only a field's type:
//   torch::nn::Linear fc{nullptr};   ->   dtp::nn::Linear fc{nullptr};
#pragma once

#include "dtp/comm_counter.h"

#include <ATen/core/Tensor.h>
#include <torch/nn/pimpl.h>

#include <array>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace dtp::nn {

// What a module needs to run hooks. Pre-hooks see the forward's tensor
// arguments in order (others pass through untouched); post-hooks see its
// tensor output.
struct HookHost {
  using PreHook = std::function<void(std::vector<at::Tensor>& inputs)>;
  using PostHook = std::function<void(at::Tensor& output)>;
  // The module's call (pre-hooks, forward, post-hooks) on these tensor
  // arguments; it may run again later (checkpoint's recompute in backward).
  using Run = std::function<at::Tensor(const std::vector<at::Tensor>& inputs)>;
  // Around the whole call, outermost last (checkpoint_wrapper); only for a
  // forward that returns one at::Tensor.
  using Wrapper = std::function<at::Tensor(const std::vector<at::Tensor>& inputs, const Run& run)>;
  std::vector<PreHook> pre_hooks;
  std::vector<PostHook> post_hooks;
  std::vector<Wrapper> wrappers;
  std::string fqn;  // set by parallelize_module; CommCounter attributes to it
  // Techniques applied to the module ("fully_shard", "replicate") with
  // their state, so that each can check the order they compose in.
  struct Applied {
    std::string technique;
    std::shared_ptr<void> state;
  };
  std::vector<Applied> applied;
  virtual ~HookHost() = default;
};

template <class Impl>
class HookedImpl : public Impl, public HookHost {
 public:
  using Impl::Impl;
};

namespace detail {

template <class T>
constexpr bool is_tensor_v = std::is_same_v<std::decay_t<T>, at::Tensor>;

// For each argument, its index among the tensor arguments (or -1).
template <class... Args>
constexpr std::array<int, sizeof...(Args)> tensorIndices() {
  std::array<int, sizeof...(Args)> idx{};
  constexpr bool is_tensor[] = {is_tensor_v<Args>..., false};
  int next = 0;
  for (size_t i = 0; i < sizeof...(Args); ++i) idx[i] = is_tensor[i] ? next++ : -1;
  return idx;
}

template <int I, class Arg>
decltype(auto) pick(Arg&& arg, std::vector<at::Tensor>& tensors) {
  if constexpr (I >= 0) return at::Tensor(tensors[I]);
  else return std::forward<Arg>(arg);
}

template <class M, class Tuple, size_t... Is, class... Args>
auto callWith(M& m, Tuple&& args, std::vector<at::Tensor>& tensors, std::index_sequence<Is...>,
              std::tuple<Args...>*) {
  constexpr auto idx = tensorIndices<Args...>();
  return m.forward(pick<idx[Is]>(std::get<Is>(std::forward<Tuple>(args)), tensors)...);
}

}  // namespace detail

namespace detail {

// NOTE: [Module tracking]: while a CommDebugMode is alive, a module with an
// FQN marks its inputs and its output with identity autograd nodes; the
// output's backward enters the module's backward (CommCounter attributes
// collectives to it), its inputs' backward leaves it (src/nn/module_tracker.cpp).
int64_t nextModuleToken();
at::Tensor markBackwardLeave(const at::Tensor& input, int64_t token);
at::Tensor markBackwardEnter(const at::Tensor& output, int64_t token, const std::string& fqn);

// m.forward with the tensor arguments taken from `tensors`, hooks around it.
template <class M, class... Args>
auto runHooks(M& m, std::vector<at::Tensor> tensors, Args&&... args) {
  HookHost& host = m;
  CommModuleScope scope(&host.fqn);
  const int64_t token = CommCounter::tracking_modules() && !host.fqn.empty() ? nextModuleToken() : 0;
  if (token != 0)
    for (auto& t : tensors) t = markBackwardLeave(t, token);
  for (auto& hook : host.pre_hooks) hook(tensors);
  auto out = detail::callWith(m, std::forward_as_tuple(std::forward<Args>(args)...), tensors,
                              std::index_sequence_for<Args...>{},
                              static_cast<std::tuple<Args...>*>(nullptr));
  if constexpr (std::is_same_v<decltype(out), at::Tensor>) {
    for (auto& hook : host.post_hooks) hook(out);
    if (token != 0) out = markBackwardEnter(out, token, host.fqn);
  } else {
    TORCH_CHECK(host.post_hooks.empty(), "Hooked: module '", host.fqn,
                "' has output hooks but its forward does not return one at::Tensor. NYI: hooks "
                "on other outputs; prepare the output in the caller instead.");
  }
  return out;
}

// runHooks with the arguments kept in a tuple (a wrapper's later call).
template <class M, class Tuple, size_t... Is>
at::Tensor runSaved(M& m, const std::vector<at::Tensor>& inputs, Tuple& saved, std::index_sequence<Is...>) {
  return runHooks(m, inputs, std::get<Is>(saved)...);
}

}  // namespace detail

// Runs m.forward(args...) with m's hooks and wrappers around it.
template <class M, class... Args>
auto run_hooked(M& m, Args&&... args) {
  HookHost& host = m;
  if (host.pre_hooks.empty() && host.post_hooks.empty() && host.wrappers.empty() &&
      (host.fqn.empty() || !CommCounter::tracking_modules()))
    return m.forward(std::forward<Args>(args)...);
  std::vector<at::Tensor> tensors;
  (
      [&](auto&& a) {
        if constexpr (detail::is_tensor_v<decltype(a)>) tensors.push_back(a);
      }(args),
      ...);
  using Out = decltype(m.forward(std::forward<Args>(args)...));
  if constexpr (std::is_same_v<Out, at::Tensor>) {
    if (!host.wrappers.empty()) {
      // The call may run again after this returns: it keeps copies of the
      // non-tensor arguments (tensor ones come from `inputs`).
      auto saved = std::make_shared<std::tuple<std::decay_t<Args>...>>(args...);
      M* self = &m;
      HookHost::Run call = [self, saved](const std::vector<at::Tensor>& inputs) {
        return detail::runSaved(*self, inputs, *saved, std::index_sequence_for<Args...>{});
      };
      for (const auto& wrapper : host.wrappers)
        call = [wrapper, inner = std::move(call)](const std::vector<at::Tensor>& inputs) { return wrapper(inputs, inner); };
      return call(tensors);
    }
  } else {
    TORCH_CHECK(host.wrappers.empty(), "Hooked: module '", host.fqn,
                "' has wrappers (checkpoint_wrapper) but its forward does not return one at::Tensor. NYI.");
  }
  return detail::runHooks(m, std::move(tensors), std::forward<Args>(args)...);
}

template <class Impl>
class Hooked : public torch::nn::ModuleHolder<HookedImpl<Impl>> {
 public:
  using torch::nn::ModuleHolder<HookedImpl<Impl>>::ModuleHolder;
  template <class... Args>
  auto operator()(Args&&... args) {
    return run_hooked(*this->get(), std::forward<Args>(args)...);
  }
};

}  // namespace dtp::nn

// Like TORCH_MODULE(Name), but the holder runs hooks: for user modules that
// parallelize_module should be able to prepare inputs and outputs of.
#define DTP_MODULE(Name)                                           \
  class Name : public ::dtp::nn::Hooked<Name##Impl> {             \
   public:                                                         \
    using ::dtp::nn::Hooked<Name##Impl>::Hooked;                   \
  }
