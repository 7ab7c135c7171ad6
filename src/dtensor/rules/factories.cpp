// Factories shaped like an input (empty_like, new_zeros...), copies and
// scalar reads.
#include "dtensor/dtensor_impl.h"
#include "dtensor/redistribute.h"
#include "dtensor/rules/common.h"

#include <ATen/ATen.h>

namespace dtp {
namespace {

// Rows that accept the input in any placement it may have on this mesh dim.
std::vector<Row> anyInput(const OpCall& c, int64_t m, bool keep_shards) {
  const Placement cur = c.spec(0).placements[m];
  Placement out = cur.is_shard() && keep_shards ? cur : Replicate();
  Row r{Placements(c.specs.size(), Replicate()), Placements(c.num_outputs, out)};
  r.in[0] = cur;
  return {r};
}

// empty_like & co.: same shards, a Partial input gives a Replicate output.
std::vector<Row> likeRows(const OpCall& c, int64_t m) { return anyInput(c, m, /*keep_shards=*/true); }
// new_zeros(size) & co.: a full-size replicated tensor whatever the input.
std::vector<Row> newRows(const OpCall& c, int64_t m) { return anyInput(c, m, /*keep_shards=*/false); }

// copy_(self, src): src takes self's placement (self is written, never
// moved), on its own aligned dim when it broadcasts (f64[5,7](S(1)) from
// f64[7]: src S(0)); a src dim it lacks or broadcasts (size 1) is replicated.
std::vector<Row> copyRows(const OpCall& c, int64_t m) {
  const Placement cur = c.spec(0).placements[m];
  Row r{Placements(c.specs.size(), cur), {cur}};
  if (cur.is_shard() && c.specs.size() == 2) {
    const int64_t d = cur.dim - (c.spec(0).ndim() - c.spec(1).ndim());
    r.in[1] = d >= 0 && c.spec(1).shape[d] == c.spec(0).shape[cur.dim] ? Shard(d) : Replicate();
  }
  return {r};
}

// item(): the value of the whole (replicated) tensor.
bool localScalarDense(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  at::Tensor t = torch::jit::pop(*stack).toTensor();
  auto* impl = unsafeGetDTensorImpl(t);
  at::Tensor full = redistribute_local(impl->local(), impl->spec(),
                                       Placements(impl->spec().placements.size(), Replicate()));
  stack->emplace_back(full);
  op.callBoxed(stack);
  return true;
}

// new_empty_strided(self, size, stride, dtype?, ...) of self's own global shape
// and dtype keeps self's spec (as PyTorch's factory strategy keeps a sharded
// input's): AccumulateGrad's clone_obey_contract asks for one to copy a
// gradient into its parameter's layout, and a Replicate there would gather
// the gradient and change its placements. Other sizes go to the rule.
bool newEmptyStridedLikeSelf(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto args = torch::jit::last(*stack, 7);
  const at::Tensor self = args[0].toTensor();
  auto* impl = maybeGetDTensorImpl(self);
  if (impl == nullptr || args[1].toIntVector() != impl->spec().shape ||
      (!args[3].isNone() && args[3].toScalarType() != self.scalar_type()))
    return false;
  const auto& sizes = impl->spec().local_sizes;
  at::Tensor local = at::empty_strided(sizes, dense_strides_like(sizes, args[2].toIntVector()),
                                       impl->local().options());
  torch::jit::drop(*stack, 7);
  stack->emplace_back(makeDTensor(std::move(local), impl->spec_ptr()));
  return true;
}

}  // namespace

void registerFactoryRules(RuleRegistry& r) {
  for (const char* op : {"aten::empty_like", "aten::zeros_like", "aten::ones_like",
                         "aten::full_like"})
    r.add(op, likeRows);
  for (const char* op : {"aten::new_zeros", "aten::new_empty", "aten::new_ones",
                         "aten::new_full", "aten::new_empty_strided"})
    r.add(op, newRows);
  r.add("aten::copy_", copyRows);
  r.add_handler("aten::_local_scalar_dense", localScalarDense);
  r.add_handler("aten::new_empty_strided", newEmptyStridedLikeSelf);
}

}  // namespace dtp
