#include "dtensor/sharding_prop.h"

#include "dtensor/dispatch_context.h"
#include "dtensor/op_args.h"
#include "dtensor/redistribute.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <sstream>
#include <unordered_set>

namespace dtp {

namespace {

using detail::Signature;

void encodeSpec(Signature& sig, const DTensorSpec& spec) {
  sig.push_back(reinterpret_cast<intptr_t>(spec.mesh.id()));
  sig.push_back(static_cast<int64_t>(spec.dtype));
  sig.push_back(spec.ndim());
  sig.insert(sig.end(), spec.shape.begin(), spec.shape.end());
  for (const auto& p : spec.placements) sig.push_back(placement_key(p));
}

void encodeValue(Signature& sig, const c10::IValue& v) {
  if (v.isTensor()) {
    const auto& t = v.toTensor();
    if (auto* impl = maybeGetDTensorImpl(t)) {
      sig.push_back(1);
      encodeSpec(sig, impl->spec());
    } else {
      sig.push_back(t.defined() ? 2 : 3);
      if (t.defined()) sig.push_back(static_cast<int64_t>(t.scalar_type()));
    }
  } else if (v.isNone()) {
    sig.push_back(3);
  } else if (v.isInt()) {
    sig.push_back(4);
    sig.push_back(v.toInt());
  } else if (v.isDouble()) {
    sig.push_back(5);
    double d = v.toDouble();
    int64_t bits;
    std::memcpy(&bits, &d, sizeof(bits));
    sig.push_back(bits);
  } else if (v.isBool()) {
    sig.push_back(6);
    sig.push_back(v.toBool());
  } else if (v.isIntList()) {
    sig.push_back(7);
    auto l = v.toIntList();
    sig.push_back(static_cast<int64_t>(l.size()));
    for (int64_t x : l) sig.push_back(x);
  } else if (v.isTensorList()) {
    sig.push_back(8);
    for (const auto& t : v.toTensorList()) encodeValue(sig, c10::IValue(at::Tensor(t)));
  } else if (v.isString()) {
    sig.push_back(9);
    sig.push_back(static_cast<int64_t>(std::hash<std::string>()(v.toStringRef())));
  } else if (v.isDevice()) {
    sig.push_back(10);
    sig.push_back(static_cast<int64_t>(v.toDevice().type()) * 256 + v.toDevice().index());
  } else if (v.isDoubleList()) {
    sig.push_back(11);
    for (double d : v.toDoubleList()) encodeValue(sig, c10::IValue(d));
  } else if (v.isBoolList()) {
    sig.push_back(12);
    for (bool b : v.toBoolList()) sig.push_back(b);
  } else {
    sig.push_back(13);  // e.g. a Generator: no bearing on sharding
  }
}

std::string describeInputs(const OpCall& call) {
  std::ostringstream os;
  for (size_t i = 0; i < call.args.size(); ++i) {
    const auto& v = call.args[i];
    os << (i ? ", " : "");
    int slot = call.slot_of_arg(static_cast<int>(i));
    if (slot >= 0) {
      os << call.spec(slot).str();
      if (v.isTensorList()) os << "...";
    } else if (v.isTensor()) {
      os << (v.toTensor().defined() ? "tensor" : "None");
    } else if (v.isList()) {  // Tensor?[] (index_put's indices): never print a DTensor's data
      os << "[";
      const auto& l = v.toListRef();
      for (size_t k = 0; k < l.size(); ++k) {
        os << (k ? ", " : "");
        const auto* impl = l[k].isTensor() ? maybeGetDTensorImpl(l[k].toTensor()) : nullptr;
        if (impl != nullptr) os << impl->spec().str();
        else if (l[k].isTensor()) os << "tensor";
        else os << l[k];
      }
      os << "]";
    } else {
      os << v;
    }
  }
  return os.str();
}

// Output shapes and dtypes from running the op on meta tensors of the global
// shapes. Runs on cache misses only.
OutputMeta runOnMeta(const OpCall& call) {
  // Shapes only: no autograd (which a user op on meta tensors lacks in 1.13).
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  torch::jit::Stack stack(call.args.begin(), call.args.end());
  map_tensor_args(stack.data(), stack.size(), [](const at::Tensor& t) -> at::Tensor {
    if (auto* impl = maybeGetDTensorImpl(t)) {
      const auto& s = impl->spec();
      return at::empty(s.shape, at::TensorOptions().dtype(s.dtype).device(at::kMeta));
    }
    return t;  // plain 0-dim scalars stay as they are
  });
  call.op.callBoxed(&stack);
  OutputMeta r;
  auto add = [&](const at::Tensor& t) {
    // An undefined output (layer norm backward with a false output_mask)
    // is marked by an Undefined dtype and stays undefined.
    r.shapes.push_back(t.defined() ? t.sizes().vec() : std::vector<int64_t>{});
    r.dtypes.push_back(t.defined() ? t.scalar_type() : c10::ScalarType::Undefined);
  };
  for (const auto& v : stack) {
    if (v.isTensor()) add(v.toTensor());
    else if (v.isTensorList())
      for (const auto& t : v.toTensorList()) add(t);
  }
  return r;
}

// Ops whose meta kernel threw once go to their rule's shape function from
// then on: a c10::Error records a backtrace (about a millisecond), and an
// embedding misses the cache at every new prompt length.
class NoMetaKernel {
 public:
  bool contains(const c10::FunctionSchema& schema) const {
    const std::lock_guard<std::mutex> lock(mutex_);
    return schemas_.count(&schema) > 0;
  }
  void insert(const c10::FunctionSchema& schema) {
    const std::lock_guard<std::mutex> lock(mutex_);
    schemas_.insert(&schema);
  }

 private:
  mutable std::mutex mutex_;
  std::unordered_set<const c10::FunctionSchema*> schemas_;
};

// The op's rule, or an error naming the ways around a missing one.
std::shared_ptr<const Rule> ruleOf(const OpCall& call) {
  std::shared_ptr<const Rule> rule = RuleRegistry::get().find(call.op.operator_name());
  TORCH_CHECK(rule != nullptr, "dtp: no sharding rule for ", op_name(call.op), " (inputs: ",
              describeInputs(call),
              "). Redistribute the inputs to Replicate and call it on to_local() tensors, or "
              "enable dtp::ReplicateFallbackGuard to do that automatically.");
  return rule;
}

// Whether every return is an argument the op writes (add_, out= variants):
// its outputs are then those arguments, shapes and placements alike.
bool returnsWrittenArgs(const c10::FunctionSchema& schema) {
  const auto& returns = schema.returns();
  bool all = !returns.empty();
  for (const auto& r : returns) all &= r.alias_info() != nullptr && r.alias_info()->isWrite();
  return all;
}

// Global shapes and dtypes of a functional op's outputs: from its meta
// kernel, or from its rule's shape function where that kernel throws.
OutputMeta outputMeta(const OpCall& call, const Rule& rule) {
  static NoMetaKernel no_meta;
  bool meta_failed = rule.shape && no_meta.contains(call.op.schema());
  OutputMeta meta;
  try {
    if (!meta_failed) meta = runOnMeta(call);
  } catch (const c10::Error& e) {
    TORCH_CHECK(rule.shape, "dtp: cannot infer the output shape of ", op_name(call.op),
                " on meta tensors (inputs: ", describeInputs(call),
                "): ", e.what_without_backtrace(), "\nRegister a Meta kernel for the op, or give its rule a "
                "shape function (dtp::RegisterShardingOptions::shape).");
    no_meta.insert(call.op.schema());
    meta_failed = true;
  }
  if (meta_failed) {
    meta = rule.shape(call);
    TORCH_INTERNAL_ASSERT(!meta.shapes.empty() && meta.shapes.size() == meta.dtypes.size(), "the shape function of ",
                          op_name(call.op), "'s rule returned ", meta.shapes.size(), " shapes and ", meta.dtypes.size(),
                          " dtypes");
  }
  return meta;
}

// The call as the rule's strategy sees it: with its output count and global
// output shapes (an op returning written arguments: its first argument's
// shape, once per return).
OpCall withOutputs(const OpCall& call, const OutputMeta& meta, bool returns_written) {
  OpCall sized = call;
  const size_t returns = call.op.schema().returns().size();
  sized.num_outputs = static_cast<int64_t>(returns_written ? returns : meta.shapes.size());
  if (returns_written) sized.out_shapes.assign(returns, call.spec(0).shape);
  else sized.out_shapes = meta.shapes;
  return sized;
}

bool isWrittenSlot(const OpCall& call, size_t slot) {
  const auto& a = call.op.schema().arguments()[call.slot_arg[slot]];
  return a.alias_info() != nullptr && a.alias_info()->isWrite();
}

// An in-place or out= op returns the argument it writes, whose placement
// stays: a row giving that output another one (mul_ of an R self by a
// P(sum) other -> P(sum)) would leave a partial value under R. Per return,
// the slot it writes (-1: none, or a functional op).
std::vector<int> writtenSlotOfReturns(const OpCall& call, bool returns_written) {
  const auto& returns = call.op.schema().returns();
  std::vector<int> written_slot(returns_written ? returns.size() : 0, -1);
  for (size_t r = 0; r < written_slot.size(); ++r) {
    const int arg = written_arg(call.op.schema(), returns[r]);
    if (arg >= 0) written_slot[r] = call.slot_of_arg(arg);
  }
  return written_slot;
}

// Whether `row` changes, on mesh dim m, the placement of an argument the op
// writes (as an input, or as the output that returns it): never allowed.
bool forbidden(const OpCall& call, const Row& row, int64_t m, const std::vector<int>& written_slot) {
  for (size_t s = 0; s < row.in.size(); ++s)
    if (isWrittenSlot(call, s) && call.spec(s).placements[m] != row.in[s]) return true;
  for (size_t o = 0; o < written_slot.size(); ++o)
    if (written_slot[o] >= 0 && row.out[o] != call.spec(written_slot[o]).placements[m]) return true;
  return false;
}

// The rule's rows for each mesh dim that keep written arguments in place, or
// an error (at the first mesh dim without one) when a dim has none.
struct DimRows {
  std::vector<Row> rows;
  std::vector<const Row*> allowed;
};
std::vector<DimRows> allowedRows(const OpCall& sized, const Rule& rule, const std::vector<int>& written_slot) {
  const int64_t ndim = sized.mesh().ndim();
  std::vector<DimRows> dims(ndim);
  for (int64_t m = 0; m < ndim; ++m) {
    dims[m].rows = rule.strategy(sized, m);
    for (const auto& row : dims[m].rows) {
      TORCH_INTERNAL_ASSERT(row.in.size() == sized.specs.size() &&
                                static_cast<int64_t>(row.out.size()) == sized.num_outputs,
                            "rule for ", op_name(sized.op), " produced a malformed row");
      if (!forbidden(sized, row, m, written_slot)) dims[m].allowed.push_back(&row);
    }
    TORCH_CHECK(!dims[m].allowed.empty(), "dtp: no valid sharding for ", op_name(sized.op), " (inputs: ",
                describeInputs(sized), ") on mesh dim ", m,
                dims[m].rows.empty() ? "." : ": it writes an argument whose placement would have to "
                                             "change. Redistribute that argument first.",
                RuleRegistry::get().hint(sized.op.operator_name()));
  }
  return dims;
}

// One input's plans to the placements candidates ask of it, each planned
// once per decision.
class SlotPlans {
 public:
  explicit SlotPlans(const DTensorSpec& spec) : spec_(&spec) {}
  const RedistributePlan& to(const Placements& dst) {
    key_.clear();
    for (const auto& p : dst) key_.push_back(placement_key(p));
    auto it = plans_.find(key_);
    if (it == plans_.end()) it = plans_.emplace(key_, plan_redistribute(*spec_, dst)).first;
    return it->second;
  }

 private:
  const DTensorSpec* spec_;
  std::vector<int64_t> key_;
  std::map<std::vector<int64_t>, RedistributePlan> plans_;
};

// Cheaper by more than rounding: sums of the same step costs in another
// order stay equal, so the first of equal candidates keeps winning.
bool cheaper(double cost, double best) { return cost < best * (1 - 1e-12); }

// A candidate: one allowed row per mesh dim (indices into DimRows::allowed).
using Candidate = std::vector<size_t>;

// Placements a candidate asks of input `slot`; `rest` fills mesh dims the
// candidate does not cover yet (pricing one mesh dim at a time).
void placementsOf(const std::vector<DimRows>& dims, const Candidate& c, size_t slot, const Placements& rest,
                  Placements& out) {
  out = rest;
  for (size_t m = 0; m < c.size(); ++m) out[m] = dims[m].allowed[c[m]]->in[slot];
}

// What running the inputs' plans to candidate `c` costs; stops early at
// `bound` (the cost is then not below it).
double candidateCost(const OpCall& sized, const std::vector<DimRows>& dims, const Candidate& c,
                     std::vector<SlotPlans>& plans, double bound) {
  thread_local Placements target;
  double cost = 0;
  for (size_t s = 0; s < plans.size() && cheaper(cost, bound); ++s) {
    placementsOf(dims, c, s, sized.spec(s).placements, target);
    cost += plans[s].to(target).cost;
  }
  return cost;
}

// The cheapest candidate, the first among equals in mesh-dim order (dim 0
// most significant): every candidate while there are at most
// kMaxPricedCandidates, else one mesh dim at a time, each priced with the
// dims before it as chosen and the dims after it as they are.
Candidate cheapestCandidate(const OpCall& sized, const std::vector<DimRows>& dims, std::vector<SlotPlans>& plans) {
  const size_t ndim = dims.size();
  size_t count = 1;
  for (const auto& d : dims) count = std::min(count * d.allowed.size(), kMaxPricedCandidates + 1);
  if (count > kMaxPricedCandidates) {
    Candidate chosen;
    for (size_t m = 0; m < ndim; ++m) {
      chosen.push_back(0);
      Candidate c = chosen;
      double best = std::numeric_limits<double>::infinity();
      for (size_t i = 0; i < dims[m].allowed.size(); ++i) {
        c[m] = i;
        const double cost = candidateCost(sized, dims, c, plans, best);
        if (cheaper(cost, best)) {
          best = cost;
          chosen[m] = i;
        }
      }
    }
    return chosen;
  }
  Candidate c(ndim, 0), best_c = c;
  double best = std::numeric_limits<double>::infinity();
  while (true) {
    const double cost = candidateCost(sized, dims, c, plans, best);
    if (cheaper(cost, best)) {
      best = cost;
      best_c = c;
    }
    size_t m = ndim;  // the next candidate: the last mesh dim turns fastest
    while (m > 0 && ++c[m - 1] == dims[m - 1].allowed.size()) c[--m] = 0;
    if (m == 0) break;
  }
  return best_c;
}

// Placements per input slot and per output, the plans that take the inputs
// there, from the cheapest candidate the rule's rows make.
struct Choice {
  std::vector<Placements> in, out;
  std::vector<RedistributePlan> plans;
};
Choice choosePlacements(const OpCall& sized, const Rule& rule, bool returns_written) {
  const std::vector<int> written_slot = writtenSlotOfReturns(sized, returns_written);
  const std::vector<DimRows> dims = allowedRows(sized, rule, written_slot);
  std::vector<SlotPlans> plans;
  for (size_t s = 0; s < sized.specs.size(); ++s) plans.emplace_back(sized.spec(s));
  const Candidate best = cheapestCandidate(sized, dims, plans);
  const int64_t ndim = sized.mesh().ndim();
  Choice c{std::vector<Placements>(sized.specs.size(), Placements(ndim)),
           std::vector<Placements>(sized.num_outputs, Placements(ndim)), {}};
  for (int64_t m = 0; m < ndim; ++m) {
    const Row& row = *dims[m].allowed[best[m]];
    for (size_t s = 0; s < row.in.size(); ++s) c.in[s][m] = row.in[s];
    for (int64_t o = 0; o < sized.num_outputs; ++o) c.out[o][m] = row.out[o];
  }
  for (size_t s = 0; s < sized.specs.size(); ++s) c.plans.push_back(plans[s].to(c.in[s]));
  return c;
}

// The outputs' specs: null for a returned written argument (the argument's
// own) and for an undefined output (an Undefined dtype in `meta`).
std::vector<SpecPtr> outputSpecs(const OpCall& call, const std::vector<Placements>& out, const OutputMeta& meta,
                                 bool returns_written) {
  std::vector<SpecPtr> specs;
  for (size_t o = 0; o < out.size(); ++o) {
    const auto dtype = returns_written ? c10::ScalarType::Undefined : meta.dtypes[o];
    specs.push_back(dtype == c10::ScalarType::Undefined ? nullptr
                                                        : make_spec(call.mesh(), out[o], meta.shapes[o], dtype));
  }
  return specs;
}

// NOTE: [Empty shards run no kernel]
// Where every output of a functional op is empty on this rank (uneven
// sharding left it no rows), the rank makes them with at::empty and runs
// no kernel: libtorch 2.x kernels divide by an empty dim's size (the CPU
// flash attention with no heads raises SIGFPE, pytorch#141219), and
// nothing is lost. Ops that alias or write an argument, return a list, or
// compute their outputs themselves (a rule's LocalFn) run as usual.
bool runsNoKernel(const c10::FunctionSchema& schema, const Decision& d, bool returns_written) {
  const auto& returns = schema.returns();
  return !returns_written && d.local == nullptr && !d.out.empty() &&
         std::all_of(returns.begin(), returns.end(), [](const c10::Argument& r) {
           return r.alias_info() == nullptr && r.type()->kind() == c10::TypeKind::TensorType;
         }) &&
         std::all_of(d.out.begin(), d.out.end(), [](const SpecPtr& o) {
           return o != nullptr && std::find(o->local_sizes.begin(), o->local_sizes.end(), 0) != o->local_sizes.end();
         });
}

// The decision for a call the cache has not seen:
//  - Find the op's rule; none is an error naming the replicate fallback.
//  - Output shapes first, as list-returning ops (split, unbind) tell their
//    output count only so: run the op on meta tensors of the global shapes,
//    or the rule's shape function where the meta kernel throws. An op that
//    returns only arguments it writes needs neither: those are its outputs.
//  - Per mesh dim, ask the rule for its rows; rows that would change the
//    placement of an argument the op writes are excluded. A candidate is
//    one row per mesh dim; keep the one whose inputs' redistribution plans
//    cost least (NOTE: [Plans priced as they run]), and keep those plans:
//    a cache hit runs them as they are.
//  - Make the specs of the inputs as redistributed and of the outputs.
//  - Mark a call whose outputs are all empty on this rank (NOTE: [Empty
//    shards run no kernel]).
PlannedDecision compute(const OpCall& call) {
  const std::shared_ptr<const Rule> rule = ruleOf(call);
  const bool returns_written = returnsWrittenArgs(call.op.schema());
  const OutputMeta meta = returns_written ? OutputMeta{} : outputMeta(call, *rule);
  const OpCall sized = withOutputs(call, meta, returns_written);
  Choice chosen = choosePlacements(sized, *rule, returns_written);

  PlannedDecision d;
  d.local = rule->local;
  for (size_t s = 0; s < chosen.in.size(); ++s)
    d.in_specs.push_back(make_spec(call.mesh(), chosen.in[s], call.spec(s).shape, call.spec(s).dtype));
  d.in = std::move(chosen.in);
  d.in_plans = std::move(chosen.plans);
  d.out = outputSpecs(call, chosen.out, meta, returns_written);
  d.empty_outputs = runsNoKernel(call.op.schema(), d, returns_written);
  return d;
}

// The cache key: the op and everything about its arguments that can change
// a decision (specs, shapes, dtypes, non-tensor values).
void encodeCall(Signature& sig, const OpCall& call) {
  const auto& schema = call.op.schema();
  sig.push_back(reinterpret_cast<intptr_t>(&schema));
  for (size_t i = 0; i < call.args.size(); ++i) {
    // Scalar operands (AdamW's bias corrections change every step) never
    // change shapes, and placements only by being zero (masked_fill with 0
    // keeps a Partial): their kind and zero-ness are enough.
    if (schema.arguments()[i].type()->kind() == c10::TypeKind::NumberType)
      sig.push_back(call.args[i].isScalar() && call.args[i].toScalar().equal(0) ? 15 : 14);
    else encodeValue(sig, call.args[i]);
  }
}

}  // namespace

// The cache is this thread's: NOTE: [Dispatch context].
void clear_propagation_cache() { detail::dispatch_context().decisions.map.clear(); }

PropagationCacheStats propagation_cache_stats() {
  const auto& decisions = detail::dispatch_context().decisions;
  PropagationCacheStats s = decisions.stats;
  s.size = static_cast<int64_t>(decisions.map.size());
  return s;
}

const PlannedDecision& propagate(const OpCall& call) {
  auto& decisions = detail::dispatch_context().decisions;
  auto& cache = decisions.map;
  if (rules_version() != decisions.rules_version) {  // a rule was added: earlier decisions may be stale
    cache.clear();
    decisions.rules_version = rules_version();
  }
  Signature& sig = decisions.key;
  sig.clear();
  encodeCall(sig, call);
  auto it = cache.find(sig);
  if (it != cache.end()) {
    ++decisions.stats.hits;
    return it->second;
  }
  ++decisions.stats.misses;
  PlannedDecision d = compute(call);
  // Bounded: programs with ever-new shapes must not grow it forever. Callers
  // use a decision before the next propagate on their thread.
  if (cache.size() >= kPropagationCacheCapacity) cache.clear();
  return cache.emplace(sig, std::move(d)).first->second;
}

}  // namespace dtp
