// The rule registry: operator names to rules, handlers and error hints,
// filled once from one place (RuleRegistry::get) and checked at start-up.
#include "dtensor/rule_registry.h"

#include "dtensor/op_args.h"

#include <algorithm>

namespace dtp {

int64_t OpCall::arg_int(size_t i, int64_t dflt) const {
  if (i >= args.size() || args[i].isNone()) return dflt;
  return args[i].toInt();
}

int OpCall::slot_of_arg(int i) const {
  for (size_t s = 0; s < slot_arg.size(); ++s)
    if (slot_arg[s] == i) return static_cast<int>(s);
  return -1;
}

void fill_slots(OpCall& call) {
  for_each_tensor_arg(call.args.data(), call.args.size(), [&](size_t i, const at::Tensor& t) {
    if (auto* impl = maybeGetDTensorImpl(t)) {
      call.specs.push_back(&impl->spec());
      call.slot_arg.push_back(static_cast<int>(i));
    }
  });
}

// One call per rule family: see NOTE: [Adding a sharding rule] (rule_registry.h).
RuleRegistry& RuleRegistry::get() {
  static RuleRegistry* registry = [] {
    auto* r = new RuleRegistry();
    registerPointwiseRules(*r);
    registerMatrixRules(*r);
    registerViewRules(*r);
    registerReductionRules(*r);
    registerFactoryRules(*r);
    registerIndexingRules(*r);
    registerNnOpRules(*r);
    registerAttentionRules(*r);
    registerConvolutionRules(*r);
    registerPoolingRules(*r);
    registerRandomRules(*r);
    registerLossRules(*r);
    return r;
  }();
  return *registry;
}

namespace {

c10::OperatorName parseName(const std::string& op) {
  auto dot = op.find('.');
  c10::OperatorName name{op.substr(0, dot), dot == std::string::npos ? "" : op.substr(dot + 1)};
  // Start-up check: a rule for an op that does not exist is a typo.
  TORCH_CHECK(c10::Dispatcher::singleton().findOp(name).has_value(),
              "dtp: sharding rule registered for unknown op '", op,
              "'. Fix the name in src/dtensor/rules/.");
  return name;
}

}  // namespace

void RuleRegistry::add(const std::string& op, StrategyFn strategy, ShapeFn shape,
                       LocalFn local) {
  rules_[parseName(op)] = std::make_shared<const Rule>(Rule{std::move(strategy), std::move(shape), local});
}

std::atomic<uint64_t> g_rules_version{0};

void RuleRegistry::add_user(const c10::OperatorName& name, Rule rule, bool replace) {
  std::unique_lock<std::shared_mutex> lock(mutex_);
  const bool exists = rules_.count(name) > 0 || handlers_.count(name) > 0;
  TORCH_CHECK(!exists || replace, "dtp::register_sharding: ",
              name.overload_name.empty() ? name.name : name.name + "." + name.overload_name,
              " already has a sharding rule (dtp's own or an earlier register_sharding). Pass "
              "RegisterShardingOptions().override_existing(true) to replace it.");
  handlers_.erase(name);
  rules_[name] = std::make_shared<const Rule>(std::move(rule));
  g_rules_version.fetch_add(1, std::memory_order_relaxed);
}

void RuleRegistry::add_technique_handler(const std::string& op, Handler handler) {
  const c10::OperatorName name = parseName(op);
  std::unique_lock<std::shared_mutex> lock(mutex_);
  TORCH_INTERNAL_ASSERT(handlers_.count(name) == 0, "a second handler registered for ", op);
  handlers_[name] = handler;
  g_rules_version.fetch_add(1, std::memory_order_relaxed);
}

void RuleRegistry::add_handler(const std::string& op, Handler handler) {
  handlers_[parseName(op)] = handler;
}

void RuleRegistry::add_hint(const std::string& op, std::string hint) {
  hints_[parseName(op)] = std::move(hint);
}

std::string RuleRegistry::hint(const c10::OperatorName& name) const {
  auto it = hints_.find(name);
  return it == hints_.end() ? std::string() : " " + it->second;
}

std::shared_ptr<const Rule> RuleRegistry::find(const c10::OperatorName& name) const {
  std::shared_lock<std::shared_mutex> lock(mutex_);
  auto it = rules_.find(name);
  return it == rules_.end() ? nullptr : it->second;
}

Handler RuleRegistry::find_handler(const c10::OperatorName& name) const {
  std::shared_lock<std::shared_mutex> lock(mutex_);
  auto it = handlers_.find(name);
  return it == handlers_.end() ? nullptr : it->second;
}

std::vector<std::string> RuleRegistry::names() const {
  std::shared_lock<std::shared_mutex> lock(mutex_);
  std::vector<std::string> out;
  auto full = [](const c10::OperatorName& n) {
    return n.overload_name.empty() ? n.name : n.name + "." + n.overload_name;
  };
  for (const auto& kv : rules_) out.push_back(full(kv.first));
  for (const auto& kv : handlers_) out.push_back(full(kv.first));
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());  // an op with a rule and a handler (norm) once
  return out;
}

}  // namespace dtp
