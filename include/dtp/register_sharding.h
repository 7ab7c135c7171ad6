// register_sharding: a sharding rule for an op dtp has none for, an ATen op or
// a user's TORCH_LIBRARY op (PyTorch's torch.distributed.tensor.experimental.
// register_sharding). A rule lists the acceptable shardings for ONE mesh
// dimension; dtp applies it to every dimension of the mesh and, per
// dimension, picks the strategy whose input placements are cheapest to reach
// from the inputs' (redistributing the inputs where needed).
//
//   // mylib::rms_rows(Tensor x, float eps) -> Tensor normalizes each row.
//   dtp::register_sharding("mylib::rms_rows", [](const dtp::ShardingCall& call) {
//     std::vector<dtp::ShardingStrategy> s = {{{dtp::Replicate()}, {dtp::Replicate()}}};
//     for (int64_t d = 0; d + 1 < call.input(0).ndim(); ++d)  // not the normalized dim
//       s.push_back({{dtp::Shard(d)}, {dtp::Shard(d)}});
//     return s;
//   });
//
// The op's output shapes come from its Meta kernel (register one with
// TORCH_LIBRARY_IMPL(mylib, Meta, m), as PyTorch requires a fake kernel), or
// from RegisterShardingOptions::shape.
#pragma once

#include "dtp/dtensor_spec.h"
#include "dtp/placement.h"

#include <ATen/core/ivalue.h>
#include <c10/util/ArrayRef.h>
#include <torch/arg.h>

#include <functional>
#include <string>
#include <vector>

namespace dtp {

struct OpCall;

// One acceptable sharding of a call on one mesh dimension: a placement for
// each DTensor input (in schema order, TensorList elements flattened) and for
// each tensor output.
struct ShardingStrategy {
  std::vector<Placement> inputs;
  std::vector<Placement> outputs;
};

// What a rule sees of the call it decides.
class ShardingCall {
 public:
  ShardingCall(const OpCall& call, int64_t mesh_dim) : call_(call), mesh_dim_(mesh_dim) {}
  // "mylib::rms_rows" or "aten::add.Tensor".
  std::string op() const;
  // The mesh dimension the strategies are for.
  int64_t mesh_dim() const { return mesh_dim_; }
  // The DTensor inputs: their global shapes, dtypes and current placements.
  size_t num_inputs() const;
  const DTensorSpec& input(size_t i) const;
  // Every argument of the call, DTensors included, in schema order: dims,
  // scalars and flags a rule may depend on.
  c10::ArrayRef<c10::IValue> args() const;
  // The tensor outputs' global shapes.
  size_t num_outputs() const;
  const std::vector<int64_t>& output_shape(size_t o) const;

 private:
  const OpCall& call_;
  int64_t mesh_dim_;
};

using ShardingRuleFn = std::function<std::vector<ShardingStrategy>(const ShardingCall& call)>;

// The global shapes and dtypes of an op's tensor outputs, for ops without a
// Meta kernel.
struct OutputShapes {
  std::vector<std::vector<int64_t>> shapes;
  std::vector<c10::ScalarType> dtypes;
};
using OutputShapeFn = std::function<OutputShapes(const ShardingCall& call)>;

struct RegisterShardingOptions {
  // Replace the rule dtp (or an earlier register_sharding) has for the op;
  // without it, that is an error.
  TORCH_ARG(bool, override_existing) = false;
  // Output shapes when the op has no Meta kernel.
  TORCH_ARG(OutputShapeFn, shape) = nullptr;
  // A label for this rule (e.g. "v2"), compared across ranks with the rest
  // of what was registered: set it when one function may be registered with
  // different captured values.
  TORCH_ARG(std::string, version) = "";
};

// Registers `rule` for `op`: "ns::name" or "ns::name.overload" (".default"
// is the unnamed overload, as in Python). The op must exist (its
// TORCH_LIBRARY registered). Register before running the op on DTensors from
// several threads; decisions cached under an earlier rule are dropped.
// Every rank must register the same rules: parallelize_module,
// distribute_module, fully_shard and replicate compare what each rank
// registered (the strategies, the function's type, the version) and refuse
// ranks that differ, naming the op and each rank's rule. See NOTE: [Ranks
// agree on sharding rules] in src/dtensor/rules_agree.h.
void register_sharding(const std::string& op, ShardingRuleFn rule,
                       const RegisterShardingOptions& options = RegisterShardingOptions());
// The same with a fixed list of strategies.
void register_sharding(const std::string& op, std::vector<ShardingStrategy> strategies,
                       const RegisterShardingOptions& options = RegisterShardingOptions());

}  // namespace dtp
