// Random-op handlers: draw the global tensor, keep the shard. See dtp/random.h.
#include "dtp/random.h"
#include "dtensor/random_state.h"

#include "dtensor/redistribute.h"
#include "dtensor/rule_registry.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <mutex>
#include <optional>
#include <vector>

namespace dtp {
namespace {

thread_local std::optional<at::Generator> thread_generator;
thread_local ProcessGroup batch_group;  // NOTE: [Random ops under data parallelism]

// NOTE: [Generator sync] Every rank must draw from the same generator state,
// or a replicated random op silently differs between ranks (ranks seeded
// differently, or one that drew extra numbers). As PyTorch's RNG tracker
// does, the first random op on a mesh after each dtp::manual_seed (and the
// first ever) gives every rank the state of the mesh's first rank: one
// broadcast per mesh dim. The decision depends only on calls every rank
// makes alike (manual_seed, random ops on the mesh), so ranks agree on it.
thread_local uint64_t seed_epoch = 0;
thread_local std::vector<std::pair<const void*, uint64_t>> synced;  // (mesh, epoch)
thread_local uint64_t batch_synced_epoch = 0;  // the dp group's, when batch_group is set

at::Generator syncedGenerator(const DeviceMesh& mesh) {
  at::Generator gen = random_generator();
  if (batch_group.valid() && batch_group.size() > 1 && batch_synced_epoch != seed_epoch + 1) {
    std::lock_guard<std::mutex> lock(gen.mutex());
    at::Tensor state = gen.get_state();
    batch_group.broadcast(state, 0);
    gen.set_state(state);
    batch_synced_epoch = seed_epoch + 1;
  }
  const std::pair<const void*, uint64_t> key{mesh.id(), seed_epoch};
  if (std::find(synced.begin(), synced.end(), key) != synced.end()) return gen;
  std::lock_guard<std::mutex> lock(gen.mutex());
  at::Tensor state = gen.get_state();
  for (int64_t m = 0; m < mesh.ndim(); ++m)
    if (mesh.size(m) > 1) mesh.get_group(m).broadcast(state, 0);
  gen.set_state(state);
  if (synced.size() >= 64) synced.clear();  // meshes made and dropped in a loop
  synced.push_back(key);
  return gen;
}

// NOTE: [Random ops under data parallelism] Inside the forward of a module
// under fully_shard or replicate, each dp rank holds its equal part of the
// batch (dim 0). One device would draw for the whole batch, so each rank
// draws a tensor dp times as long along dim 0 (the whole batch) and keeps its
// own rows: data-parallel ranks get one device's dropout masks, not dp copies
// of one mask. The generator is also synced over dp, as over the mesh.
std::vector<int64_t> drawShape(const DTensorSpec& spec) {
  auto shape = spec.shape;
  if (batch_group.valid() && !shape.empty()) shape[0] *= batch_group.size();
  return shape;
}

// This rank's shard of a full tensor drawn in drawShape(spec).
at::Tensor shardOf(const at::Tensor& drawn, const DTensorSpec& spec) {
  at::Tensor t = drawn;
  if (t.dim() > 0 && t.size(0) != spec.shape[0]) t = t.narrow(0, batch_group.rank() * spec.shape[0], spec.shape[0]);
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
  if (args[g].isNone()) args[g] = syncedGenerator(spec.mesh);
  args[0] = at::empty(drawShape(spec), impl->local().options());
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
  at::Tensor mask_full = at::empty(drawShape(spec), local.options().dtype(at::kBool));
  mask_full.bernoulli_(p1m, syncedGenerator(spec.mesh));
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
  if (batch_group.valid() && spec.ndim() > 0)  // the whole batch's input
    args[0] = batch_group.all_gather(args[0].toTensor(), 0, std::vector<int64_t>(batch_group.size(), spec.shape[0])).wait();
  const size_t g = generatorArg(op.schema());
  if (args[g].isNone()) args[g] = syncedGenerator(spec.mesh);
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
  at::Generator gen = syncedGenerator(spec.mesh);
  if (Normal) full.normal_(0, 1, gen);
  else full.uniform_(0, 1, gen);
  torch::jit::drop(*stack, nargs);
  auto out_spec = withoutPartial(spec, full.scalar_type());
  stack->emplace_back(makeDTensor(shardOf(full, *out_spec).contiguous(), out_spec));
  return true;
}

}  // namespace

void manual_seed(uint64_t seed) {
  thread_generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  ++seed_epoch;  // the next random op on each mesh syncs (NOTE: [Generator sync])
}

void detail::set_data_parallel_batch(ProcessGroup dp) { batch_group = std::move(dp); }

namespace {

at::Tensor stateOf(at::Generator gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void restore(at::Generator gen, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

}  // namespace

detail::RandomState detail::get_random_state() {
  return {stateOf(random_generator()), stateOf(at::detail::getDefaultCPUGenerator()), synced, batch_synced_epoch,
          batch_group};
}

void detail::set_random_state(const RandomState& state) {
  restore(random_generator(), state.generator);
  restore(at::detail::getDefaultCPUGenerator(), state.default_generator);
  synced = state.synced;
  batch_synced_epoch = state.batch_synced_epoch;
  batch_group = state.batch;
}

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
