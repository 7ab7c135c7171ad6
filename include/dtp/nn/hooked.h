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

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace dtp::nn {

// What one slot of a forward's arguments or outputs holds.
enum class SlotKind : uint8_t {
  kTensor,          // an at::Tensor (undefined for a defaulted `const at::Tensor& mask = {}`)
  kOptionalTensor,  // a std::optional<at::Tensor>: undefined when absent
  kOther,           // anything else (an int, a bool, a KVCache&): passes through untouched
};

// NOTE: [Forward slots] A forward's arguments, or its outputs, one slot each
// in order, as PyTorch's hooks see `inputs` and `outputs`: for
//   std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x, int64_t pos,
//                                              std::optional<at::Tensor> mask);
// the inputs are 3 slots (x, undefined for pos, mask or undefined) and the
// outputs 2. A forward returning one at::Tensor has one output slot, a
// std::vector<at::Tensor> one per element, a std::tuple one per element;
// anything else is one kOther slot. Hooks may replace the tensor of a
// tensor slot, never add or remove slots.
struct Slots : std::vector<at::Tensor> {
  std::vector<SlotKind> kinds;
  void add(at::Tensor t, SlotKind kind) {
    push_back(std::move(t));
    kinds.push_back(kind);
  }
  bool is_tensor(size_t i) const { return kinds[i] != SlotKind::kOther; }
};

// An output hook: a callable taking the outputs' Slots&. One taking the
// output as at::Tensor& (the previous release's form) still converts, for
// a forward with one tensor output, until the next release.
class PostHook {
 public:
  template <class F, std::enable_if_t<std::is_invocable_v<F&, Slots&>, int> = 0>
  PostHook(F f) : fn_(std::move(f)) {}  // NOLINT: implicit, as std::function's
#ifndef DTP_NO_DEPRECATED
  template <class F,
            std::enable_if_t<!std::is_invocable_v<F&, Slots&> && std::is_invocable_v<F&, at::Tensor&>, int> = 0>
  [[deprecated("an output hook takes dtp::nn::Slots& (one slot per output, NOTE: [Forward slots]); the at::Tensor& "
               "form is removed in the next release")]] PostHook(F f)  // NOLINT
      : fn_([f = std::move(f)](Slots& out) mutable {
          TORCH_CHECK(out.size() == 1 && out.is_tensor(0), "Hooked: an output hook taking at::Tensor& needs a forward "
                      "returning one tensor; this one returns ", out.size(), " outputs. Take dtp::nn::Slots& instead.");
          f(out[0]);
        }) {}
#endif
  void operator()(Slots& outputs) const { fn_(outputs); }

 private:
  std::function<void(Slots&)> fn_;
};

// What a module needs to run hooks.
struct HookHost {
  using PreHook = std::function<void(Slots& inputs)>;
  using PostHook = nn::PostHook;
  // The module's call (pre-hooks, forward, post-hooks) on these input slots'
  // tensors, returning its output slots' tensors; it may run again later
  // (checkpoint's recompute in backward).
  using Run = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>& inputs)>;
  // Around the whole call, outermost last (checkpoint_wrapper); for a
  // forward whose outputs are all tensors (at::Tensor, std::vector of them,
  // or a std::tuple of at::Tensor / std::optional<at::Tensor>).
  using Wrapper = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>& inputs, const Run& run)>;
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
  // The names of forward's arguments, in order, as DTP_FORWARD_ARGS gives
  // them (empty when the module names none): the keys of
  // PrepareModuleInput's input_kwarg_layouts.
  virtual std::vector<std::string> forward_arg_names() const { return {}; }
  virtual ~HookHost() = default;
};

// Names a module's forward arguments once, inside its Impl, so that a plan
// can key layouts by name (PyTorch's input_kwarg_layouts):
//   struct BlockImpl : torch::nn::Module {
//     DTP_FORWARD_ARGS("x", "freqs_cis", "mask");
//     at::Tensor forward(const at::Tensor& x, const at::Tensor& freqs_cis, const at::Tensor& mask);
//   };
#define DTP_FORWARD_ARGS(...) \
  static std::vector<std::string> dtp_forward_args() { return {__VA_ARGS__}; }

namespace detail {

template <class T, class = void>
struct NamesArgs : std::false_type {};
template <class T>
struct NamesArgs<T, std::void_t<decltype(T::dtp_forward_args())>> : std::true_type {};

}  // namespace detail

template <class Impl>
class HookedImpl : public Impl, public HookHost {
 public:
  using Impl::Impl;
  std::vector<std::string> forward_arg_names() const override {
    if constexpr (detail::NamesArgs<Impl>::value) return Impl::dtp_forward_args();
    else return {};
  }
};

namespace detail {

template <class T>
constexpr bool is_tensor_v = std::is_same_v<std::decay_t<T>, at::Tensor>;
template <class T>
constexpr bool is_optional_tensor_v = std::is_same_v<std::decay_t<T>, std::optional<at::Tensor>> ||
                                      std::is_same_v<std::decay_t<T>, c10::optional<at::Tensor>>;

// `std::nullopt` passed for a std::optional<at::Tensor> parameter: an absent
// optional tensor (the call's type is all a hook can see).
template <class T>
constexpr bool is_nullopt_v =
    std::is_same_v<std::decay_t<T>, std::nullopt_t> || std::is_same_v<std::decay_t<T>, c10::nullopt_t>;

template <class T>
constexpr SlotKind slotKind() {
  if constexpr (is_tensor_v<T>) return SlotKind::kTensor;
  else if constexpr (is_optional_tensor_v<T> || is_nullopt_v<T>) return SlotKind::kOptionalTensor;
  else return SlotKind::kOther;
}

template <class T>
at::Tensor slotValue(const T& v) {
  if constexpr (is_tensor_v<T>) return v;
  else if constexpr (is_optional_tensor_v<T>) return v.has_value() ? *v : at::Tensor();
  else return at::Tensor();
}

// An argument for forward: a tensor slot's (possibly replaced) tensor, or the
// caller's own argument.
template <size_t I, class Arg>
decltype(auto) pick(Arg&& arg, const Slots& slots) {
  using D = std::decay_t<Arg>;
  if constexpr (is_tensor_v<Arg>) return at::Tensor(slots[I]);
  else if constexpr (is_optional_tensor_v<Arg>) return slots[I].defined() ? D(slots[I]) : D();
  else return std::forward<Arg>(arg);
}

template <class M, class Tuple, size_t... Is>
decltype(auto) callWith(M& m, Tuple&& args, const Slots& slots, std::index_sequence<Is...>) {
  return m.forward(pick<Is>(std::get<Is>(std::forward<Tuple>(args)), slots)...);
}

template <class... Args>
Slots inputSlots(const Args&... args) {
  Slots s;
  s.reserve(sizeof...(Args));
  (s.add(slotValue(args), slotKind<Args>()), ...);
  return s;
}

// How a forward's result maps to output slots. See NOTE: [Forward slots].
template <class T>
struct ElementSlot {  // one slot of a tuple
  static constexpr bool kTensors = slotKind<T>() != SlotKind::kOther;
  static void collect(const T& v, Slots& s) { s.add(slotValue(v), slotKind<T>()); }
  static void write(T& v, const at::Tensor& t) {
    if constexpr (is_tensor_v<T>) v = t;
    else if constexpr (is_optional_tensor_v<T>) v = t.defined() ? T(t) : T();
  }
  static T make(const at::Tensor& t) {
    if constexpr (is_tensor_v<T>) return t;
    else return t.defined() ? T(t) : T();
  }
};

template <class Out>
struct OutputSlots : ElementSlot<Out> {
  static Slots of(const Out& out) {
    Slots s;
    ElementSlot<Out>::collect(out, s);
    return s;
  }
  static void write(Out& out, const Slots& s) { ElementSlot<Out>::write(out, s[0]); }
  static Out make(const std::vector<at::Tensor>& t) { return ElementSlot<Out>::make(t.at(0)); }
};

template <>
struct OutputSlots<std::vector<at::Tensor>> {
  static constexpr bool kTensors = true;
  static Slots of(const std::vector<at::Tensor>& out) {
    Slots s;
    for (const auto& t : out) s.add(t, SlotKind::kTensor);
    return s;
  }
  static void write(std::vector<at::Tensor>& out, const Slots& s) { out.assign(s.begin(), s.end()); }
  static std::vector<at::Tensor> make(const std::vector<at::Tensor>& t) { return t; }
};

template <class... Ts>
struct OutputSlots<std::tuple<Ts...>> {
  static constexpr bool kTensors = (ElementSlot<Ts>::kTensors && ...);
  static Slots of(const std::tuple<Ts...>& out) {
    Slots s;
    std::apply([&](const auto&... v) { (ElementSlot<std::decay_t<decltype(v)>>::collect(v, s), ...); }, out);
    return s;
  }
  static void write(std::tuple<Ts...>& out, const Slots& s) {
    writeAt(out, s, std::index_sequence_for<Ts...>{});
  }
  static std::tuple<Ts...> make(const std::vector<at::Tensor>& t) {
    return makeAt(t, std::index_sequence_for<Ts...>{});
  }

 private:
  template <size_t... Is>
  static void writeAt(std::tuple<Ts...>& out, const Slots& s, std::index_sequence<Is...>) {
    (ElementSlot<Ts>::write(std::get<Is>(out), s[Is]), ...);
  }
  template <size_t... Is>
  static std::tuple<Ts...> makeAt(const std::vector<at::Tensor>& t, std::index_sequence<Is...>) {
    return std::tuple<Ts...>(ElementSlot<Ts>::make(t.at(Is))...);
  }
};

// NOTE: [Module tracking]: while a CommDebugMode is alive, a module with an
// FQN marks its inputs and its outputs with identity autograd nodes; an
// output's backward enters the module's backward (CommCounter attributes
// collectives to it), its inputs' backward leaves it (src/nn/module_tracker.cpp).
int64_t nextModuleToken();
at::Tensor markBackwardLeave(const at::Tensor& input, int64_t token);
at::Tensor markBackwardEnter(const at::Tensor& output, int64_t token, const std::string& fqn);

// m.forward with the tensor arguments taken from `inputs`, hooks around it.
template <class M, class... Args>
auto runHooks(M& m, Slots inputs, Args&&... args) {
  HookHost& host = m;
  CommModuleScope scope(&host.fqn);
  const int64_t token = CommCounter::tracking_modules() && !host.fqn.empty() ? nextModuleToken() : 0;
  if (token != 0)
    for (auto& t : inputs) t = markBackwardLeave(t, token);
  for (auto& hook : host.pre_hooks) hook(inputs);
  auto out = detail::callWith(m, std::forward_as_tuple(std::forward<Args>(args)...), inputs,
                              std::index_sequence_for<Args...>{});
  if (!host.post_hooks.empty() || token != 0) {
    using Out = decltype(out);
    Slots outputs = OutputSlots<Out>::of(out);
    const size_t n = outputs.size();
    for (auto& hook : host.post_hooks) hook(outputs);
    TORCH_INTERNAL_ASSERT(outputs.size() == n, "an output hook of '", host.fqn, "' changed the number of outputs");
    if (token != 0)
      for (auto& t : outputs) t = markBackwardEnter(t, token, host.fqn);
    OutputSlots<Out>::write(out, outputs);
  }
  return out;
}

// runHooks with the arguments kept in a tuple (a wrapper's later call).
template <class M, class Tuple, size_t... Is>
auto runSaved(M& m, Slots inputs, Tuple& saved, std::index_sequence<Is...>) {
  return runHooks(m, std::move(inputs), std::get<Is>(saved)...);
}

}  // namespace detail

// Runs m.forward(args...) with m's hooks and wrappers around it.
template <class M, class... Args>
auto run_hooked(M& m, Args&&... args) {
  HookHost& host = m;
  if (host.pre_hooks.empty() && host.post_hooks.empty() && host.wrappers.empty() &&
      (host.fqn.empty() || !CommCounter::tracking_modules()))
    return m.forward(std::forward<Args>(args)...);
  Slots inputs = detail::inputSlots(args...);
  using Out = decltype(m.forward(std::forward<Args>(args)...));
  if (!host.wrappers.empty()) {
    if constexpr (detail::OutputSlots<Out>::kTensors) {
      // The call may run again after this returns: it keeps copies of the
      // non-tensor arguments (tensor ones come from `inputs`).
      auto saved = std::make_shared<std::tuple<std::decay_t<Args>...>>(args...);
      M* self = &m;
      HookHost::Run call = [self, saved, kinds = inputs.kinds](const std::vector<at::Tensor>& in) {
        Slots slots;
        static_cast<std::vector<at::Tensor>&>(slots) = in;
        slots.kinds = kinds;
        auto out = detail::runSaved(*self, std::move(slots), *saved, std::index_sequence_for<Args...>{});
        Slots outs = detail::OutputSlots<Out>::of(out);
        return std::vector<at::Tensor>(outs.begin(), outs.end());
      };
      for (const auto& wrapper : host.wrappers)
        call = [wrapper, inner = std::move(call)](const std::vector<at::Tensor>& in) { return wrapper(in, inner); };
      return detail::OutputSlots<Out>::make(call(inputs));
    } else {
      TORCH_CHECK(false, "Hooked: module '", host.fqn, "' has wrappers (checkpoint_wrapper), but its forward returns "
                  "something other than tensors (at::Tensor, std::vector<at::Tensor>, or a std::tuple of at::Tensor "
                  "and std::optional<at::Tensor>). NYI: checkpoint such a module with dtp::checkpoint around the "
                  "tensors it returns.");
    }
  }
  return detail::runHooks(m, std::move(inputs), std::forward<Args>(args)...);
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
