// The sharding-rule registry: what a rule sees of a call (OpCall), what it
// answers (Rows per mesh dimension), and the registry that maps operator
// names to rules, handlers and error hints. Rules come in four kinds,
// cheapest first (docs/architecture.md, "Sharding propagation"):
//   1. pointwise tables for one mesh dimension (rules/pointwise.cpp),
//   2. einsum-style specs for matrix ops (rules/matrix.cpp),
//   3. view dim-maps (rules/view.cpp),
//   4. hand-written strategy functions (rules/*.cpp).
// The propagator (sharding_prop.h) picks among a rule's rows.
//
// NOTE: [Adding a sharding rule]
// 1. The rule: one line in its family's register*Rules(RuleRegistry&) under
//    src/dtensor/rules/ (pointwise.cpp, matrix.cpp, view.cpp, ...; shared
//    helpers in rules/common.h): r.add("aten::op.overload", strategy) with
//    a shape function or LocalFn where needed, or r.add_handler for an op
//    that takes the call whole (random ops). A misspelt op name fails at
//    start-up. A new family file also declares its register*Rules below,
//    is called from RuleRegistry::get (rule_registry.cpp) and is listed in
//    CMakeLists.txt.
// 2. An op-sweep sample, in the family's *Samples(Table&) of
//    tests/op_sweep_samples.h: t.add("aten::op.overload", {T({5, 7}), ...}),
//    arguments positional in schema order. OpSweep.EverySupportedOpHasSamples
//    fails for a registered op without one; OpSweep.EveryCaseMatchesOneDevice-
//    OrNamesItsOp runs each sample under every placement on meshes (2), (4)
//    and (2,2) against one device in float64.
// 3. A golden line in the family's ShardingRuleTest of
//    tests/sharding_rules_test.cpp (RuleGolden, tests/rule_golden.h):
//      EXPECT_EQ(g.propagate("aten::mm", {g.t("f32[8,16](S(0))"), g.t("f32[16,4](R)")}),
//                "S(0), R -> f32[8,4](S(0))");
// 4. Run them:
//      cmake --build build --target dtp_tests
//      build/tests/dtp_tests --gtest_filter='ShardingRuleTest.*:OpSweep.*'
//    and scripts/op-table.sh to refresh docs/dtensor.md's op table.
#pragma once

#include "dtensor/dtensor_impl.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/SmallVector.h>

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <string>
#include <unordered_map>

namespace dtp {

// The call as a rule sees it. Tensor "slots" are the DTensor arguments in
// schema order, with TensorList elements flattened.
struct OpCall {
  const c10::OperatorHandle& op;
  c10::ArrayRef<c10::IValue> args;
  c10::SmallVector<const DTensorSpec*, 4> specs;  // one per slot
  c10::SmallVector<int, 4> slot_arg;              // argument index of each slot
  int64_t num_outputs = 0;                // tensor returns (list returns: elements)
  std::vector<std::vector<int64_t>> out_shapes;  // global, one per tensor output

  const DTensorSpec& spec(size_t slot) const { return *specs[slot]; }
  const DeviceMesh& mesh() const { return specs[0]->mesh; }
  int64_t arg_int(size_t i, int64_t dflt = 0) const;
  // The slot of argument `i`, or -1 when it is not a DTensor.
  int slot_of_arg(int i) const;
};

// Fills call.specs and call.slot_arg from call.args: its DTensor arguments in
// schema order, TensorList elements flattened.
void fill_slots(OpCall& call);

// One candidate for one mesh dimension.
struct Row {
  std::vector<Placement> in;   // per slot
  std::vector<Placement> out;  // per tensor output
};

using StrategyFn = std::function<std::vector<Row>(const OpCall& call, int64_t mesh_dim)>;
// Global shapes and dtypes of an op's tensor outputs.
struct OutputMeta {
  std::vector<std::vector<int64_t>> shapes;
  std::vector<c10::ScalarType> dtypes;
};
// Output shapes for ops whose meta kernel is missing in some libtorch version
// (tried when running on meta tensors fails).
using ShapeFn = std::function<OutputMeta(const OpCall& call)>;
struct Decision;
// Computes the outputs from the unwrapped (local) arguments on the stack, in
// place of running the op, for ops whose arguments are global (view sizes).
using LocalFn = void (*)(const c10::OperatorHandle& op, torch::jit::Stack* stack,
                         const Decision& d);
// Takes the whole op over (random ops, scalar reads, full norms); returns
// false, leaving the stack untouched, to hand the call to the op's rule.
using Handler = bool (*)(const c10::OperatorHandle& op, torch::jit::Stack* stack);

// What the propagator decided for a call, handed to a rule's LocalFn.
struct Decision {
  std::vector<Placements> in;  // per slot
  std::vector<SpecPtr> in_specs;  // per slot, after redistribution
  std::vector<SpecPtr> out;    // per tensor output (null for in-place: the input's)
  LocalFn local = nullptr;     // the rule's, if any
  bool empty_outputs = false;  // NOTE: [Empty shards run no kernel]
};

struct Rule {
  StrategyFn strategy;
  ShapeFn shape;          // optional
  LocalFn local = nullptr;  // optional
};

class RuleRegistry {
 public:
  static RuleRegistry& get();
  // `op` like "aten::add.Tensor"; the op must exist (checked at start-up).
  void add(const std::string& op, StrategyFn strategy, ShapeFn shape = nullptr,
           LocalFn local = nullptr);
  void add_handler(const std::string& op, Handler handler);
  // A hint appended to errors about `op` (a mix of plain and DTensor
  // arguments, no valid sharding): how the feature that owns the op is used.
  void add_hint(const std::string& op, std::string hint);
  // A rule added while programs run (dtp::register_sharding): replaces the
  // op's rule and handler when `replace`, else an existing one is an error.
  // Bumps rules_version(), which drops the decisions threads have cached.
  void add_user(const c10::OperatorName& name, Rule rule, bool replace);
  // A handler a technique above the core registers while programs run
  // (loss_parallel: NOTE: [loss_parallel's handlers] in
  // src/tp/loss_parallel_rules.h). The op keeps its rule, which takes the
  // calls the handler declines. A second handler for the op is an invariant
  // violation. Bumps rules_version().
  void add_technique_handler(const std::string& op, Handler handler);
  std::shared_ptr<const Rule> find(const c10::OperatorName& name) const;
  Handler find_handler(const c10::OperatorName& name) const;
  // " <hint>" for errors about `name`, or "".
  std::string hint(const c10::OperatorName& name) const;
  // Names registered, for the start-up check and documentation.
  std::vector<std::string> names() const;

 private:
  // Written by add_user after start-up; read on cache misses.
  mutable std::shared_mutex mutex_;
  std::unordered_map<c10::OperatorName, std::shared_ptr<const Rule>> rules_;
  std::unordered_map<c10::OperatorName, Handler> handlers_;
  std::unordered_map<c10::OperatorName, std::string> hints_;
};

// Changes whenever a rule is added after start-up: per-thread caches of
// decisions and op facts compare it (one relaxed load per op).
extern std::atomic<uint64_t> g_rules_version;
inline uint64_t rules_version() { return g_rules_version.load(std::memory_order_relaxed); }

// Registration of every rule family, called once from one place.
void registerPointwiseRules(RuleRegistry& r);
void registerMatrixRules(RuleRegistry& r);
void registerViewRules(RuleRegistry& r);
void registerReductionRules(RuleRegistry& r);
void registerFactoryRules(RuleRegistry& r);
void registerIndexingRules(RuleRegistry& r);
void registerNnOpRules(RuleRegistry& r);
void registerAttentionRules(RuleRegistry& r);
void registerConvolutionRules(RuleRegistry& r);
void registerPoolingRules(RuleRegistry& r);
void registerRandomRules(RuleRegistry& r);
void registerLossRules(RuleRegistry& r);

}  // namespace dtp
