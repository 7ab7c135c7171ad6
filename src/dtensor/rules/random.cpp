// Random-op handlers: draw the global tensor, keep the shard. See dtp/random.h.
#include "dtp/random.h"

#include "dtensor/redistribute.h"
#include "dtensor/rule_registry.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <optional>

namespace dtp {
namespace {

thread_local std::optional<at::Generator> thread_generator;

// This rank's shard of a full tensor laid out by `spec`.
at::Tensor shardOf(const at::Tensor& full, const DTensorSpec& spec) {
  at::Tensor t = full;
  const auto off = spec.local_offset();
  for (int64_t d = 0; d < spec.ndim(); ++d) {
    if (spec.local_sizes[d] != spec.shape[d]) t = t.narrow(d, off[d], spec.local_sizes[d]);
  }
  return t;
}

SpecPtr withoutPartial(const DTensorSpec& spec, c10::ScalarType dtype) {
  Placements p = spec.placements;
  for (auto& x : p)
    if (x.is_partial()) x = Replicate();
  return make_spec(spec.mesh, p, spec.shape, dtype);
}

// Index of the Generator? argument, which every handled op has.
size_t generatorArg(const c10::FunctionSchema& schema) {
  const auto& args = schema.arguments();
  for (size_t i = 0; i < args.size(); ++i)
    if (args[i].name() == "generator") return i;
  TORCH_INTERNAL_ASSERT(false, "random op without a generator argument: ", schema.name());
  return 0;
}

// In-place fills whose result does not depend on self's values (uniform_,
// normal_, bernoulli_(float)): draw a full tensor, copy the shard into self.
bool fillInPlace(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t nargs = op.schema().arguments().size();
  c10::IValue* args = &*(stack->end() - static_cast<std::ptrdiff_t>(nargs));
  at::Tensor self = args[0].toTensor();
  auto* impl = unsafeGetDTensorImpl(self);
  const auto& spec = impl->spec();
  TORCH_CHECK(!spec.has_partial(), "dtp: ", op.schema().name(), " on a Partial DTensor ",
              spec.str(), " would make the sum of random shards. Redistribute it to Replicate or "
              "Shard first.");
  for (size_t i = 1; i < nargs; ++i) {
    TORCH_CHECK(!args[i].isTensor() || !isDTensor(args[i].toTensor()), "dtp: ",
                op.schema().name(), " with DTensor parameters is NYI; pass scalars.");
  }
  const size_t g = generatorArg(op.schema());
  if (args[g].isNone()) args[g] = random_generator();
  args[0] = at::empty(spec.shape, impl->local().options());
  op.callBoxed(stack);
  at::Tensor full = torch::jit::pop(*stack).toTensor();
  impl->local().copy_(shardOf(full, spec));
  stack->emplace_back(self);
  return true;
}

// native_dropout(input, p, train) -> (output, mask), with CPU's arithmetic:
// mask ~ bernoulli(1-p) drawn for the global shape, output = input*mask*scale.
bool nativeDropout(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto train = torch::jit::pop(*stack).toOptional<bool>();
  const double p = torch::jit::pop(*stack).toDouble();
  at::Tensor input = torch::jit::pop(*stack).toTensor();
  auto* impl = unsafeGetDTensorImpl(input);
  const auto& spec = impl->spec();
  const at::Tensor& local = impl->local();
  auto mask_spec = withoutPartial(spec, at::kBool);
  if (train.has_value() && !*train) {
    stack->emplace_back(makeDTensor(local.clone(), impl->spec_ptr()));
    stack->emplace_back(makeDTensor(at::ones_like(local, local.options().dtype(at::kBool)), mask_spec));
    return true;
  }
  const double p1m = 1. - p;
  const double scale = p1m == 0 ? 0. : 1. / p1m;
  at::Tensor mask_full = at::empty(spec.shape, local.options().dtype(at::kBool));
  mask_full.bernoulli_(p1m, random_generator());
  at::Tensor mask = shardOf(mask_full, spec).contiguous();
  // Dropout is linear in its input: a Partial input stays Partial.
  stack->emplace_back(makeDTensor(local.mul(mask).mul_(scale), impl->spec_ptr()));
  stack->emplace_back(makeDTensor(mask, mask_spec));
  return true;
}

// Functional random ops whose result depends on the input's values
// (bernoulli(probs)) or shape only (rand_like): run on the full input with
// the shared generator, keep the shard.
bool onFullInput(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t nargs = op.schema().arguments().size();
  c10::IValue* args = &*(stack->end() - static_cast<std::ptrdiff_t>(nargs));
  at::Tensor input = args[0].toTensor();
  auto* impl = unsafeGetDTensorImpl(input);
  const auto& spec = impl->spec();
  args[0] = redistribute_local(impl->local(), spec, Placements(spec.placements.size(), Replicate()));
  const size_t g = generatorArg(op.schema());
  if (args[g].isNone()) args[g] = random_generator();
  op.callBoxed(stack);
  at::Tensor full = torch::jit::pop(*stack).toTensor();
  auto out_spec = withoutPartial(spec, full.scalar_type());
  stack->emplace_back(makeDTensor(shardOf(full, *out_spec).contiguous(), out_spec));
  return true;
}

// rand_like / randn_like(self, dtype?, ...): empty_like(self).uniform_(0, 1)
// (normal_(0, 1)) for the global shape, as a single device computes them.
template <bool Normal>
bool randLike(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t nargs = op.schema().arguments().size();
  auto args = torch::jit::last(*stack, nargs);
  at::Tensor self = args[0].toTensor();
  auto dtype = args[1].toOptional<at::ScalarType>();
  auto* impl = unsafeGetDTensorImpl(self);
  const auto& spec = impl->spec();
  at::Tensor full = at::empty(spec.shape, impl->local().options().dtype(dtype.value_or(spec.dtype)));
  if (Normal) full.normal_(0, 1, random_generator());
  else full.uniform_(0, 1, random_generator());
  torch::jit::drop(*stack, nargs);
  auto out_spec = withoutPartial(spec, full.scalar_type());
  stack->emplace_back(makeDTensor(shardOf(full, *out_spec).contiguous(), out_spec));
  return true;
}

}  // namespace

void manual_seed(uint64_t seed) { thread_generator = at::make_generator<at::CPUGeneratorImpl>(seed); }

at::Generator random_generator() {
  return thread_generator ? *thread_generator : at::detail::getDefaultCPUGenerator();
}

void registerRandomRules(RuleRegistry& r) {
  for (const char* op : {"aten::uniform_", "aten::normal_", "aten::bernoulli_.float"})
    r.add_handler(op, fillInPlace);
  r.add_handler("aten::native_dropout", nativeDropout);
  r.add_handler("aten::bernoulli", onFullInput);
  r.add_handler("aten::bernoulli.p", onFullInput);
  r.add_handler("aten::rand_like", randLike<false>);
  r.add_handler("aten::randn_like", randLike<true>);
}

}  // namespace dtp
