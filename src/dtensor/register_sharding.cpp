// dtp::register_sharding: user rules enter the registry as a fourth-kind
// strategy function (rule_registry.h) whose rows are checked, because the
// user's function is outside dtp's own tests.
#include "dtp/register_sharding.h"

#include "dtensor/dispatch.h"
#include "dtensor/op_args.h"
#include "dtensor/rule_registry.h"
#include "dtensor/rules_agree.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Type.h>

#include <dlfcn.h>

#include <sstream>

namespace dtp {

std::string ShardingCall::op() const { return op_name(call_.op); }
size_t ShardingCall::num_inputs() const { return call_.specs.size(); }
const DTensorSpec& ShardingCall::input(size_t i) const {
  TORCH_CHECK(i < call_.specs.size(), "ShardingCall::input(", i, "): ", op(), " has ", call_.specs.size(),
              " DTensor inputs.");
  return *call_.specs[i];
}
c10::ArrayRef<c10::IValue> ShardingCall::args() const { return call_.args; }
size_t ShardingCall::num_outputs() const { return call_.out_shapes.size(); }
const std::vector<int64_t>& ShardingCall::output_shape(size_t o) const {
  TORCH_CHECK(o < call_.out_shapes.size(), "ShardingCall::output_shape(", o, "): ", op(), " has ",
              call_.out_shapes.size(), " tensor outputs here (none inside a shape function).");
  return call_.out_shapes[o];
}

namespace {

c10::OperatorHandle findOp(const std::string& op) {
  const auto dot = op.find('.');
  std::string overload = dot == std::string::npos ? "" : op.substr(dot + 1);
  if (overload == "default") overload.clear();
  const c10::OperatorName name{op.substr(0, dot), overload};
  auto handle = c10::Dispatcher::singleton().findOp(name);
  TORCH_CHECK(handle.has_value(), "dtp::register_sharding: no op '", op, "' is registered. Define it with "
              "TORCH_LIBRARY before registering its rule, and name it 'ns::name' or 'ns::name.overload'.");
  return *handle;
}

// The rows of one strategy, with Shard dims made non-negative; a strategy
// that does not fit the call is an error naming the op and the strategy.
Row rowOf(const ShardingCall& call, const ShardingStrategy& s, size_t index) {
  TORCH_CHECK(s.inputs.size() == call.num_inputs() && s.outputs.size() == call.num_outputs(),
              "dtp::register_sharding: the rule for ", call.op(), " returned strategy ", index, " with ",
              s.inputs.size(), " input and ", s.outputs.size(), " output placements; the call has ",
              call.num_inputs(), " DTensor inputs and ", call.num_outputs(), " tensor outputs. Give one "
              "placement per DTensor input (TensorList elements each) and per tensor output.");
  auto fit = [&](Placement p, int64_t ndim, const char* what, size_t i) {
    if (!p.is_shard()) return p;
    TORCH_CHECK(p.dim >= -ndim && p.dim < ndim, "dtp::register_sharding: the rule for ", call.op(),
                " returned strategy ", index, " with ", p.str(), " for ", what, " ", i, ", which has ", ndim,
                " dims.");
    return Shard(p.dim < 0 ? p.dim + ndim : p.dim);
  };
  Row row;
  for (size_t i = 0; i < s.inputs.size(); ++i) row.in.push_back(fit(s.inputs[i], call.input(i).ndim(), "input", i));
  for (size_t o = 0; o < s.outputs.size(); ++o)
    row.out.push_back(fit(s.outputs[o], static_cast<int64_t>(call.output_shape(o).size()), "output", o));
  return row;
}

// What a callable is, the same in every process of one binary: a lambda's or
// functor's type (each lambda has its own), or a function pointer's symbol
// (or its offset in its file: addresses differ between processes).
template <typename Fn, typename Ptr>
std::string describeCallable(const Fn& fn) {
  if (const Ptr* ptr = fn.template target<Ptr>()) {
    Dl_info info{};
    const void* addr = reinterpret_cast<const void*>(*ptr);
    if (dladdr(addr, &info) != 0) {
      if (info.dli_sname != nullptr) return "function " + c10::demangle(info.dli_sname);
      std::string file = info.dli_fname != nullptr ? info.dli_fname : "?";
      file = file.substr(file.rfind('/') + 1);
      std::ostringstream os;
      os << "function at " << file << "+0x" << std::hex
         << (reinterpret_cast<uintptr_t>(addr) - reinterpret_cast<uintptr_t>(info.dli_fbase));
      return os.str();
    }
    return "function pointer";
  }
  return "function " + c10::demangle(fn.target_type().name());
}

std::string describeStrategies(const std::vector<ShardingStrategy>& strategies) {
  std::string out = "strategies";
  for (const auto& s : strategies) {
    out += " [";
    for (size_t i = 0; i < s.inputs.size(); ++i) out += (i ? ", " : "") + s.inputs[i].str();
    out += " -> ";
    for (size_t o = 0; o < s.outputs.size(); ++o) out += (o ? ", " : "") + s.outputs[o].str();
    out += "]";
  }
  return out;
}

void registerRule(const std::string& op, ShardingRuleFn rule, const RegisterShardingOptions& options,
                  std::string description) {
  TORCH_CHECK(rule != nullptr, "dtp::register_sharding: the rule for '", op, "' is empty.");
  const c10::OperatorHandle handle = findOp(op);
  TORCH_CHECK(!handle.hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd),
              "dtp::register_sharding: ", op_name(handle), " is CompositeImplicitAutograd: it decomposes into "
              "other ops before reaching DTensor, so a rule for it would never run. Give rules for the ops it "
              "decomposes into, or register its kernel for a backend key or CompositeExplicitAutograd.");
  Rule r;
  r.strategy = [rule](const OpCall& call, int64_t mesh_dim) {
    const ShardingCall view(call, mesh_dim);
    const std::vector<ShardingStrategy> strategies = rule(view);
    if (strategies.empty()) {
      std::string inputs;
      for (size_t i = 0; i < view.num_inputs(); ++i) inputs += (i ? ", " : "") + view.input(i).str();
      TORCH_CHECK(false, "dtp::register_sharding: the rule for ", view.op(), " returned no strategy for the call (",
                  inputs, ") on mesh dimension ", mesh_dim, ": got 0 strategies, expected at least one. Return every "
                  "placement the op supports, and at least the all-Replicate one ({Replicate()} for each input and "
                  "output), which fits every op that runs on whole tensors.");
    }
    std::vector<Row> rows;
    for (size_t k = 0; k < strategies.size(); ++k) rows.push_back(rowOf(view, strategies[k], k));
    return rows;
  };
  if (options.shape()) {
    r.shape = [shape = options.shape()](const OpCall& call) {
      OutputShapes s = shape(ShardingCall(call, 0));
      TORCH_CHECK(!s.shapes.empty() && s.shapes.size() == s.dtypes.size(), "dtp::register_sharding: the shape "
                  "function for ", op_name(call.op), " returned ", s.shapes.size(), " shapes and ", s.dtypes.size(),
                  " dtypes. Give one shape and one dtype per tensor output.");
      return OutputMeta{std::move(s.shapes), std::move(s.dtypes)};
    };
  }
  route_to_dtensor_fallback(handle);
  RuleRegistry::get().add_user(handle.operator_name(), std::move(r), options.override_existing());
  // See NOTE: [Ranks agree on sharding rules]
  if (options.shape())
    description += ", shape " + describeCallable<OutputShapeFn, OutputShapes (*)(const ShardingCall&)>(options.shape());
  if (!options.version().empty()) description += ", version '" + options.version() + "'";
  record_user_rule(op_name(handle), std::move(description));
}

}  // namespace

void register_sharding(const std::string& op, ShardingRuleFn rule, const RegisterShardingOptions& options) {
  std::string description =
      rule ? describeCallable<ShardingRuleFn, std::vector<ShardingStrategy> (*)(const ShardingCall&)>(rule) : "";
  registerRule(op, std::move(rule), options, std::move(description));
}

void register_sharding(const std::string& op, std::vector<ShardingStrategy> strategies,
                       const RegisterShardingOptions& options) {
  std::string description = describeStrategies(strategies);
  registerRule(
      op, [strategies = std::move(strategies)](const ShardingCall&) { return strategies; }, options,
      std::move(description));
}

}  // namespace dtp
