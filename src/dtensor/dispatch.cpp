#include "dtensor/dispatch.h"

#include "comm/result_tape.h"
#include "comm/trace_span.h"
#include "dtensor/dispatch_context.h"
#include "dtensor/explicit_redistribute.h"
#include "dtensor/fused_ops.h"
#include "dtensor/op_args.h"
#include "dtensor/redistribute.h"
#include "dtensor/rules_agree.h"
#include "dtensor/sharding_prop.h"
#include "dtensor/spec_facts.h"
#include "dtp/comm_counter.h"
#include "dtp/dtensor.h"

#include <ATen/ATen.h>
#include <c10/util/Logging.h>
#include <torch/library.h>

#include <mutex>
#include <unordered_map>
#include <utility>

namespace dtp {
namespace {

using detail::DispatchContext;
using detail::dispatch_context;

// Finds the DTensor slots of the call, checks their meshes, and turns plain
// tensors into replicated DTensors under ImplicitReplicationGuard.
OpCall collectSlots(DispatchContext& ctx, const c10::OperatorHandle& op, torch::jit::Stack* stack, size_t nargs) {
  c10::IValue* args = &*(stack->end() - static_cast<std::ptrdiff_t>(nargs));
  const DTensorSpec* first = nullptr;
  std::string plain;  // the first plain tensor argument, for the error
  for_each_tensor_arg(args, nargs, [&](size_t i, const at::Tensor& t) {
    if (auto* impl = maybeGetDTensorImpl(t)) {
      if (first == nullptr) first = &impl->spec();
      TORCH_CHECK(impl->spec().mesh == first->mesh, "dtp: ", op_name(op),
                  " got DTensors on different meshes: ", first->mesh.str(), " and ",
                  impl->spec().mesh.str(), ". Redistribute them onto one mesh first.");
    } else if (t.defined() && t.dim() > 0 && plain.empty()) {
      plain = "'" + op.schema().arguments()[i].name() + "' (" + short_dtype_name(t.scalar_type()) +
              c10::str(t.sizes()) + ")";
    }
  });
  TORCH_INTERNAL_ASSERT(first != nullptr, "DTensor fallback reached without a DTensor argument");
  if (!plain.empty()) {
    // NOTE: [Mix hints]: the error consumes the hint it shows.
    const bool implicit = ctx.implicit_replication.get(false);
    const auto hint = implicit ? nullptr : std::exchange(ctx.mix_hint, nullptr);
    TORCH_CHECK(implicit, "dtp: ", op_name(op),
                " got a mix of plain at::Tensor and DTensor arguments: ", plain,
                " is a plain tensor. Convert it with dtp::distribute_tensor or "
                "dtp::from_local, or run the op inside dtp::ImplicitReplicationGuard to treat "
                "it as replicated.", RuleRegistry::get().hint(op.operator_name()),
                hint ? " " + *hint : std::string());
    map_tensor_args(args, nargs, [&](const at::Tensor& t) -> at::Tensor {
      if (!t.defined() || t.dim() == 0 || isDTensor(t)) return t;
      return makeDTensor(t, make_spec(first->mesh, Placements(first->mesh.ndim(), Replicate()),
                                      t.sizes().vec(), t.scalar_type()));
    });
  }
  OpCall call{op, c10::ArrayRef<c10::IValue>(args, nargs), {}, {}, 0};
  fill_slots(call);
  return call;
}

// Gathers every DTensor argument to Replicate, runs the op on full tensors and
// returns replicated DTensors. Opt-in via ReplicateFallbackGuard.
void replicateFallback(DispatchContext& ctx, const c10::OperatorHandle& op, torch::jit::Stack* stack, OpCall& call) {
  if (ctx.warned_replicate.insert(op_name(op)).second) {
    TORCH_WARN("dtp: no sharding rule for ", op_name(op),
               "; gathering its inputs to Replicate (ReplicateFallbackGuard). This costs "
               "communication and memory; add a rule for speed.");
  }
  const DeviceMesh mesh = call.mesh();
  const size_t nargs = call.args.size();
  c10::IValue* args = &*(stack->end() - static_cast<std::ptrdiff_t>(nargs));
  auto full = [](const at::Tensor& t) {
    if (auto* impl = maybeGetDTensorImpl(t)) {
      return redistribute_local(impl->local(), impl->spec(),
                                Placements(impl->spec().placements.size(), Replicate()));
    }
    return t;
  };
  for (const auto& a : op.schema().arguments()) {
    TORCH_CHECK(a.alias_info() == nullptr || !a.alias_info()->isWrite(), "dtp: ", op_name(op),
                " writes its arguments and has no sharding rule; the replicate fallback "
                "cannot run in-place ops.");
  }
  map_tensor_args(args, nargs, full);
  op.callBoxed(stack);
  const size_t nret = op.schema().returns().size();
  auto wrap = [&](const at::Tensor& t) {
    return makeDTensor(t, make_spec(mesh, Placements(mesh.ndim(), Replicate()), t.sizes().vec(),
                                    t.scalar_type()));
  };
  map_tensor_args(&*(stack->end() - static_cast<std::ptrdiff_t>(nret)), nret, wrap);
}

// The input's local shard after the decision's plan for it (NOTE: [Plans
// priced as they run]): the steps priced when the decision was made.
at::Tensor localFor(const at::Tensor& t, const RedistributePlan& plan) {
  auto* impl = unsafeGetDTensorImpl(t);
  return run_redistribute(impl->local(), impl->spec(), plan);
}

// What the fallback needs to know of `op`, from this thread's cache.
const detail::OpInfo& opInfo(DispatchContext& ctx, const c10::OperatorHandle& op) {
  auto& infos = ctx.op_infos;
  if (rules_version() != infos.rules_version) {
    infos.map.clear();
    infos.rules_version = rules_version();
  }
  auto [it, fresh] = infos.map.try_emplace(&op.schema());
  if (fresh) {
    const auto& registry = RuleRegistry::get();
    it->second.handler = registry.find_handler(op.operator_name());
    it->second.has_rule = registry.find(op.operator_name()) != nullptr;
    it->second.user_rule = it->second.has_rule && has_user_rule(op_name(op));
    for (const auto& r : op.schema().returns())
      it->second.writes |= r.alias_info() != nullptr && r.alias_info()->isWrite();
    it->second.single_output = !it->second.writes && op.schema().returns().size() == 1;
    it->second.product = detail::fused_product_of(op);
  }
  return it->second;
}

// The first dispatch, on this thread (this rank), of an op with a user rule
// on `mesh` checks that the ranks registered the same rule for it (NOTE:
// [Ranks agree on sharding rules]); later calls find the pair here. Not in
// OpInfo: a rank's rules_version() moves when it registers, so its OpInfo
// cache empties at calls where other ranks' does not, and a check must run at
// the same call on every rank. Holding the mesh keeps its id from being
// reused.
void checkUserRuleOnce(DispatchContext& ctx, const c10::OperatorHandle& op, const DeviceMesh& mesh) {
  auto& checked = ctx.checked_user_rules;
  for (const auto& [schema, m] : checked)
    if (schema == &op.schema() && (m.id() == mesh.id() || m == mesh)) return;
  check_user_rule_agrees(mesh, op_name(op));
  checked.emplace_back(&op.schema(), mesh);
}

// Names the op to CommCounter while it runs (collectives it issues are its).
class CurrentOp {
 public:
  explicit CurrentOp(const c10::OperatorHandle& op) : prev_(CommCounter::current_op()) {
    CommCounter::set_current_op(&op.operator_name().name, &op.operator_name().overload_name);
  }
  ~CurrentOp() { CommCounter::set_current_op(prev_.first, prev_.second); }

 private:
  std::pair<const std::string*, const std::string*> prev_;
};

// "DTensor aten::mm (S(0), R) -> (S(0))": the op's span in traces, with its
// inputs' placements as they come and its outputs' (NOTE: [Trace spans]).
std::string opSpanName(const OpCall& call, const Decision& d) {
  std::string name = "DTensor " + call.op.schema().name() + " (";
  for (size_t i = 0; i < call.specs.size(); ++i) name += (i ? ", " : "") + to_string(call.spec(i).placements);
  name += ") -> (";
  for (size_t o = 0; o < d.out.size(); ++o) name += (o ? ", " : "") + (d.out[o] ? to_string(d.out[o]->placements) : "in place");
  return name + ")";
}

// The local output the kernel computed must be the shard its spec says. A
// mismatch comes from a user rule (register_sharding) whose output shapes or
// placements are not what the op computes: a user error, named as such.
at::Tensor wrapOutput(const c10::OperatorHandle& op, const at::Tensor& local, const SpecPtr& spec) {
  if (isDTensor(local)) {  // a LocalFn's, with per-call facts in its spec (NOTE: [Facts in specs])
    TORCH_INTERNAL_ASSERT(unsafeGetDTensorImpl(local)->spec() == *spec, op_name(op), " returned ",
                          unsafeGetDTensorImpl(local)->spec().str(), " where its decision says ", spec->str());
    return local;
  }
  TORCH_CHECK(local.sizes() == c10::IntArrayRef(spec->local_sizes), "dtp: ", op_name(op), " computed a local output of ",
              local.sizes(), " here, but sharding propagation says ", spec->str(), ", whose local shard here is ",
              c10::IntArrayRef(spec->local_sizes), ". If you registered a rule for ", op_name(op),
              " (register_sharding), your rule's output shapes (the op's Meta kernel or the shape function) or its "
              "output placements do not match what the op computes: fix the rule. Otherwise this is a dtp bug.");
  return makeDTensor(local, spec);
}

// NOTE: [Dispatch]
// The DTensor fallback: every ATen op on a DTensor lands here, below autograd.
// What it reads besides its arguments and the rule registry is this thread's
// DispatchContext (NOTE: [Dispatch context]): the guards' switches and the
// caches below (op infos, decisions with their plans, user rules checked).
//  - Fused products: aten::linear and aten::matmul (CompositeImplicitAutograd,
//    routed here by their autograd kernels when no graph is recorded) whose
//    shapes do not fuse, or under DecomposeFusedOpsGuard, run ATen's
//    decomposition, each piece a DTensor op; the others go on as one op
//    (NOTE: [Which products fuse], fused_ops.h).
//  - Ops with a handler (random ops, scalar reads...) are handed over whole
//    when the handler takes them.
//  - Replay: in selective AC's recomputation, an op its save list keeps
//    returns the first pass's output (NOTE: [Result tape]).
//  - Unwrap: find the DTensor arguments ("slots"); check they share a mesh;
//    plain tensors are an error unless ImplicitReplicationGuard is on
//    (0-dim plain tensors pass as scalars).
//  - An op without a rule, under ReplicateFallbackGuard: gather to
//    Replicate, run on the full tensors, return replicated DTensors.
//  - Propagate: the cached decision says which placements each input needs
//    and what each output is (sharding_prop.cpp). In the explicit-
//    redistribution mode, a decision that costs a collective is reported.
//  - An op with a user rule (register_sharding), at its first dispatch on
//    a mesh, checks that every rank registered the same rule for it.
//  - Redistribute inputs whose placement differs (written arguments never do)
//    by the plans the decision keeps: a cache hit plans nothing. Reading an
//    input's shard waits, once, for an async redistribution that still
//    computes it (NOTE: [Async redistribution]); deciding reads only specs.
//  - Run the op on the local shards.
//  - Wrap: outputs become DTensors with the decided specs; in-place and out=
//    returns give back the original DTensor argument. A LocalFn may wrap its
//    output itself, to carry facts only the call knows (MaskPartial's mask),
//    and a view's output keeps its input's facts (NOTE: [Facts in specs]).
void dtensorFallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  DispatchContext& ctx = dispatch_context();  // NOTE: [Dispatch context]
  const detail::OpInfo& info = opInfo(ctx, op);
  if (info.product != detail::FusedProduct::None && detail::decompose_product(info.product, *stack)) return;
  const CurrentOp current(op);
  const auto& schema = op.schema();
  if (info.handler != nullptr && info.handler(op, stack)) return;
  const size_t nargs = schema.arguments().size();
  // NOTE: [Result tape]: selective activation checkpointing keeps the
  // outputs of the ops its save list names from the first pass and hands
  // them back in the recomputation.
  detail::ResultTape* tape = info.single_output ? detail::active_tape(detail::TapeKind::SavedOps) : nullptr;
  if (tape != nullptr && !tape->keeps(schema.name())) tape = nullptr;
  if (tape != nullptr && tape->replaying()) {
    torch::jit::drop(*stack, nargs);
    stack->emplace_back(tape->pop());
    return;
  }
  OpCall call = collectSlots(ctx, op, stack, nargs);
  if (!info.has_rule && ctx.replicate_fallback.get(false)) {
    replicateFallback(ctx, op, stack, call);
    return;
  }
  const PlannedDecision& d = propagate(call);
  // After the local decision (a rule's own error stays on the rank that
  // raised it), before any communication.
  if (info.user_rule) checkUserRuleOnce(ctx, op, call.mesh());
  if (explicit_redistribute_active()) check_implicit_redistribution(call, d);
  const detail::TraceSpan span([&] { return opSpanName(call, d); });

  c10::IValue* args = &*(stack->end() - static_cast<std::ptrdiff_t>(nargs));
  // Taken before the inputs are unwrapped (their DTensors may go with them).
  const std::shared_ptr<const SpecFacts> facts = call.spec(0).facts;
  c10::SmallVector<c10::IValue, 4> originals;  // the DTensors written returns give back
  if (info.writes) originals.assign(args, args + nargs);
  size_t slot = 0;
  map_tensor_args(args, nargs, [&](const at::Tensor& t) { return isDTensor(t) ? localFor(t, d.in_plans[slot++]) : t; });
  if (d.local) {
    d.local(op, stack, d);
  } else if (d.empty_outputs) {  // NOTE: [Empty shards run no kernel]
    torch::jit::drop(*stack, nargs);
    const c10::Device device = call.mesh().device();
    for (const auto& o : d.out) stack->emplace_back(at::empty(o->local_sizes, at::TensorOptions(o->dtype).device(device)));
  } else {
    op.callBoxed(stack);
  }

  const auto& returns = schema.returns();
  auto ret = stack->end() - static_cast<std::ptrdiff_t>(returns.size());
  size_t out = 0;
  for (size_t r = 0; r < returns.size(); ++r, ++ret) {
    const auto& info = returns[r].alias_info();
    if (info != nullptr && info->isWrite()) {
      const int written = written_arg(schema, returns[r]);
      TORCH_INTERNAL_ASSERT(written >= 0, "no argument aliases return ", r, " of ", schema.name());
      *ret = originals[written];
      ++out;
    } else if (ret->isTensor()) {
      const auto& spec = d.out[out++];
      if (spec) *ret = wrapOutput(op, ret->toTensor(), facts && info != nullptr ? with_facts(spec, facts) : spec);
      if (tape != nullptr) {
        auto* impl = spec ? unsafeGetDTensorImpl(ret->toTensor()) : nullptr;
        tape->push(impl ? makeDTensor(impl->local().clone(), impl->spec_ptr()) : ret->toTensor().clone());
      }
    } else if (ret->isTensorList()) {
      std::vector<at::Tensor> l;
      for (const auto& t : ret->toTensorList()) l.push_back(wrapOutput(op, t, d.out[out++]));
      *ret = l;
    }
  }
}

}  // namespace

void detail::dtensor_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) { dtensorFallback(op, stack); }

// The public guards are scopes of the context's switches (NOTE: [Dispatch
// context]).
ImplicitReplicationGuard::ImplicitReplicationGuard() { dispatch_context().implicit_replication.enter(this, true); }
ImplicitReplicationGuard::~ImplicitReplicationGuard() { dispatch_context().implicit_replication.leave(this); }
bool ImplicitReplicationGuard::enabled() { return dispatch_context().implicit_replication.get(false); }

ReplicateFallbackGuard::ReplicateFallbackGuard() { dispatch_context().replicate_fallback.enter(this, true); }
ReplicateFallbackGuard::~ReplicateFallbackGuard() { dispatch_context().replicate_fallback.leave(this); }
bool ReplicateFallbackGuard::enabled() { return dispatch_context().replicate_fallback.get(false); }

std::vector<std::string> supported_ops() { return RuleRegistry::get().names(); }

void ensure_dtensor_dispatch() {
  static std::once_flag once;
  std::call_once(once, [] {
    RuleRegistry::get();  // validates every rule's op name
    // Ops with CompositeExplicitAutograd kernels would run those instead of
    // the fallback (addmm would allocate a plain output), so each gets the
    // fallback as its PrivateUse1 kernel. CompositeImplicitAutograd ops
    // (linear...) must keep decomposing above autograd and are left alone.
    static auto* lib = new torch::Library(torch::Library::IMPL, "aten",
                                          c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
    auto& dispatcher = c10::Dispatcher::singleton();
    for (const auto& name : dispatcher.getAllOpNames()) {
      if (name.name.rfind("aten::", 0) != 0) continue;
      auto op = dispatcher.findOp(name);
      if (!op) continue;
      const bool explicit_kernel =
          op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) ||
          op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional);
      if (!explicit_kernel ||
          op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd) ||
          op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1)) {
        continue;
      }
      std::string n = name.name.substr(6);
      if (!name.overload_name.empty()) n += "." + name.overload_name;
      lib->impl(n.c_str(), torch::CppFunction::makeFromBoxedFunction<&dtensorFallback>());
    }
    // linear and matmul (CompositeImplicitAutograd) reach the DTensor key
    // only from their own autograd kernels: NOTE: [Fused ops without autograd].
    for (const char* product : detail::kFusedProductOps)
      lib->impl(product, torch::CppFunction::makeFromBoxedFunction<&dtensorFallback>());
    detail::register_fused_ops();
    static auto* fallback = new torch::Library(torch::Library::IMPL, "_",
                                               c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
    fallback->fallback(torch::CppFunction::makeFromBoxedFunction<&dtensorFallback>());
    // Ops without an autograd kernel (a user's TORCH_LIBRARY op) pass the
    // autograd key of a DTensor as they pass AutogradCPU's; libtorch 1.13
    // registers that fallthrough for the CPU/CUDA keys only, 2.x for all.
    if (!dispatcher.hasBackendFallbackForDispatchKey(c10::DispatchKey::AutogradPrivateUse1)) {
      static auto* autograd = new torch::Library(torch::Library::IMPL, "_", c10::DispatchKey::AutogradPrivateUse1,
                                                 __FILE__, __LINE__);
      autograd->fallback(torch::CppFunction::makeFallthrough());
    }
  });
}

void route_to_dtensor_fallback(const c10::OperatorHandle& op) {
  ensure_dtensor_dispatch();
  if (!op.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) ||
      op.hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1)) {
    return;
  }
  static std::mutex mutex;
  static auto* libraries = new std::unordered_map<std::string, torch::Library*>();
  std::lock_guard<std::mutex> lock(mutex);
  const auto& name = op.operator_name().name;
  const std::string ns = name.substr(0, name.find("::"));
  auto [it, fresh] = libraries->try_emplace(ns, nullptr);
  if (fresh) it->second = new torch::Library(torch::Library::IMPL, ns, c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  std::string n = name.substr(ns.size() + 2);
  if (!op.operator_name().overload_name.empty()) n += "." + op.operator_name().overload_name;
  it->second->impl(n.c_str(), torch::CppFunction::makeFromBoxedFunction<&dtensorFallback>());
}

}  // namespace dtp
