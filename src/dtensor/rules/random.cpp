// Random-op handlers: draw the global tensor, keep the shard. See dtp/random.h;
// the generators they draw from are random_state.cpp's.
#include "dtensor/dtensor_impl.h"
#include "dtensor/random_state.h"
#include "dtensor/redistribute.h"
#include "dtensor/rule_registry.h"

#include <ATen/ATen.h>

#include <mutex>
#include <vector>

namespace dtp {
namespace {

// NOTE: [Random ops under data parallelism] Inside the forward of a module
// under fully_shard or replicate, each dp rank holds its equal part of the
// batch (dim 0). One device would draw for the whole batch, so each rank
// draws a tensor dp times as long along dim 0 (the whole batch) and keeps its
// own rows: data-parallel ranks get one device's dropout masks, not dp copies
// of one mask. The generator is also synced over dp, as over the mesh
// (detail::synced_generator).
std::vector<int64_t> drawShape(const DTensorSpec& spec) {
  auto shape = spec.shape;
  const ProcessGroup batch = detail::data_parallel_batch();
  if (batch.valid() && !shape.empty()) shape[0] *= batch.size();
  return shape;
}

// This rank's shard of a full tensor drawn in drawShape(spec).
at::Tensor shardOf(const at::Tensor& drawn, const DTensorSpec& spec) {
  at::Tensor t = drawn;
  if (t.dim() > 0 && t.size(0) != spec.shape[0])  // drawn for the dp batch
    t = t.narrow(0, detail::data_parallel_batch().rank() * spec.shape[0], spec.shape[0]);
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
  if (args[g].isNone()) args[g] = detail::synced_generator(spec.mesh, self.device());
  args[0] = at::empty(drawShape(spec), impl->local().options());
  op.callBoxed(stack);
  at::Tensor full = torch::jit::pop(*stack).toTensor();
  impl->local().copy_(shardOf(full, spec));
  stack->emplace_back(self);
  return true;
}

// The keep-mask one device's native_dropout draws for `shape` (keep with
// probability p1m). CPU: bernoulli(p1m) on a contiguous mask, as ATen's CPU
// dropout. CUDA: ATen's fused dropout kernel, whose Philox use differs from
// bernoulli_'s and which takes no generator: it runs on ones of the input's
// dtype (its kernel choice depends on the dtype) with `gen`'s state lent to
// the device's default generator and taken back after. That kernel gives
// each thread elements in memory order (vectorized, for a dense input): the
// ones are laid out as the input (`layout`: the DTensor's strides, those of
// a dense global tensor, NOTE: [DTensor strides]), so that a transposed
// input draws the mask one GPU draws for it.
at::Tensor dropoutMask(std::vector<int64_t> shape, c10::IntArrayRef layout, double p1m, const at::TensorOptions& like,
                       at::Generator gen) {
  if (!like.device().is_cuda())
    return at::empty(shape, like.dtype(at::kBool)).bernoulli_(p1m, gen);
  at::Generator device_default = at::globalContext().defaultGenerator(like.device());
  auto draw = [&] {
    const at::Tensor ones = at::empty_strided(shape, dense_strides_like(shape, layout), like).fill_(1);
    return std::get<1>(at::native_dropout(ones, 1. - p1m, /*train=*/true));
  };
  if (device_default.unsafeGetGeneratorImpl() == gen.unsafeGetGeneratorImpl()) return draw();
  at::Tensor saved;
  {
    std::scoped_lock lock(gen.mutex(), device_default.mutex());
    saved = device_default.get_state();
    device_default.set_state(gen.get_state());
  }
  at::Tensor mask = draw();  // locks the default generator itself: not held here
  std::scoped_lock lock(gen.mutex(), device_default.mutex());
  gen.set_state(device_default.get_state());
  device_default.set_state(saved);
  return mask;
}

// native_dropout(input, p, train) -> (output, mask): the mask one device
// draws for the global shape (dropoutMask), output = input*mask*scale.
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
  at::Tensor mask_full = dropoutMask(drawShape(spec), input.strides(), p1m, local.options(),
                                       detail::synced_generator(spec.mesh, local.device()));
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
  const ProcessGroup batch = detail::data_parallel_batch();
  if (batch.valid() && spec.ndim() > 0)  // the whole batch's input
    args[0] = batch.all_gather(args[0].toTensor(), 0, std::vector<int64_t>(batch.size(), spec.shape[0])).wait();
  const size_t g = generatorArg(op.schema());
  if (args[g].isNone()) args[g] = detail::synced_generator(spec.mesh, input.device());
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
  at::Tensor full = at::empty(drawShape(spec), impl->local().options().dtype(dtype.value_or(spec.dtype)));
  at::Generator gen = detail::synced_generator(spec.mesh, self.device());
  if (Normal) full.normal_(0, 1, gen);
  else full.uniform_(0, 1, gen);
  torch::jit::drop(*stack, nargs);
  auto out_spec = withoutPartial(spec, full.scalar_type());
  stack->emplace_back(makeDTensor(shardOf(full, *out_spec).contiguous(), out_spec));
  return true;
}

}  // namespace

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
