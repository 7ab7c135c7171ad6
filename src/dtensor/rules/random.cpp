// Random-op handlers. RandomMode::Global: draw the global tensor, keep the
// shard. RandomMode::PerShard: draw the shard's elements only (NOTE:
// [Per-shard random numbers] in philox.h). See dtp/random.h; the generators
// and stream they draw from are random_state.cpp's.
#include "dtensor/dtensor_impl.h"
#include "dtensor/op_args.h"
#include "dtensor/philox.h"
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

// ---- RandomMode::PerShard ----

bool perShard() { return random_mode() == RandomMode::PerShard; }

// This rank's box of the draw (NOTE: [Random ops under data parallelism]: the
// dp part of the batch, then the shard within it), filled from the per-shard
// stream into `out` (contiguous, the local shape).
void perShardInto(const std::string& op, const DTensorSpec& spec, const detail::PhiloxDraw& draw, at::Tensor& out) {
  const std::vector<int64_t> shape = drawShape(spec);
  std::vector<int64_t> offset = spec.local_offset();
  if (shape.size() > 0 && shape[0] != spec.shape[0]) offset[0] += detail::data_parallel_batch().rank() * spec.shape[0];
  detail::draw_per_shard(op, out, draw, shape, offset, &spec.mesh);
}

at::Tensor perShardLocal(const std::string& op, const DTensorSpec& spec, const detail::PhiloxDraw& draw,
                         const at::TensorOptions& options) {
  at::Tensor out = at::empty(spec.local_sizes, options);
  perShardInto(op, spec, draw, out);
  return out;
}

void noGeneratorUnderPerShard(const c10::OperatorHandle& op, const c10::IValue& generator) {
  TORCH_CHECK(generator.isNone(), "dtp: an explicit generator for ", op_name(op),
              " under RandomMode::PerShard: got a Generator, expected none (the per-shard stream is seeded "
              "by dtp::manual_seed). Pass no generator, or call dtp::set_random_mode(RandomMode::Global).");
}

// ---- Both modes ----

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
  if (perShard()) {
    noGeneratorUnderPerShard(op, args[g]);
    const std::string name = op_name(op);
    detail::PhiloxDraw draw;
    if (name == "aten::uniform_") draw = {detail::DrawKind::Uniform, args[1].toDouble(), args[2].toDouble()};
    else if (name == "aten::normal_") draw = {detail::DrawKind::Normal, args[1].toDouble(), args[2].toDouble()};
    else draw = {detail::DrawKind::Bernoulli, args[1].toDouble()};  // bernoulli_.float
    at::Tensor local = impl->local();
    if (local.is_contiguous()) perShardInto(name, spec, draw, local);  // no temporary
    else local.copy_(perShardLocal(name, spec, draw, local.options()));
    torch::jit::drop(*stack, nargs);
    stack->emplace_back(self);
    return true;
  }
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
  at::Tensor mask;
  if (perShard()) {
    mask = perShardLocal(op_name(op), spec, {detail::DrawKind::Bernoulli, p1m}, local.options().dtype(at::kBool));
  } else {
    at::Tensor mask_full = dropoutMask(drawShape(spec), input.strides(), p1m, local.options(),
                                       detail::synced_generator(spec.mesh, local.device()));
    mask = shardOf(mask_full, spec).contiguous();
  }
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
  if (perShard()) {  // bernoulli(probs): this shard's probabilities; bernoulli.p(self, p)
    const size_t g = generatorArg(op.schema());
    noGeneratorUnderPerShard(op, args[g]);
    auto out_spec = withoutPartial(spec, spec.dtype);
    detail::PhiloxDraw draw{detail::DrawKind::Bernoulli};
    if (g == 2) {
      draw.a = args[1].toDouble();
    } else {
      draw.probs = spec.has_partial() ? redistribute_local(impl->local(), spec, out_spec->placements) : impl->local();
      draw.probs = draw.probs.contiguous();
    }
    at::Tensor out = perShardLocal(op_name(op), *out_spec, draw, impl->local().options());
    torch::jit::drop(*stack, nargs);
    stack->emplace_back(makeDTensor(out, out_spec));
    return true;
  }
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
  if (perShard()) {
    auto out_spec = withoutPartial(spec, dtype.value_or(spec.dtype));
    detail::PhiloxDraw draw{Normal ? detail::DrawKind::Normal : detail::DrawKind::Uniform, 0., 1.};
    at::Tensor out = perShardLocal(op_name(op), *out_spec, draw, impl->local().options().dtype(out_spec->dtype));
    torch::jit::drop(*stack, nargs);
    stack->emplace_back(makeDTensor(out, out_spec));
    return true;
  }
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
