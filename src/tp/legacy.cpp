#include "dtp/tp/legacy.h"

#include "dtp/dtensor.h"
#include "dtp/nn/multihead_attention.h"
#include "dtp/tp/parallelize.h"

#include <torch/nn/modules/linear.h>

namespace dtp {
namespace {

void checkOneDim(const DeviceMesh& mesh, const char* fn) {
  TORCH_CHECK(mesh.ndim() == 1, fn, ": needs a 1-D mesh, got ", mesh.str(), ". Slice it by name (mesh[\"tp\"]).");
}

// `t` laid out as `layout`: a DTensor is redistributed to it, a plain tensor
// is taken as this rank's part of it.
at::Tensor inLayout(const at::Tensor& t, const DeviceMesh& mesh, Placement layout, const char* fn) {
  checkOneDim(mesh, fn);
  return is_dtensor(t) ? redistribute(t, mesh, {layout}) : from_local(t, mesh, {layout}, /*run_check=*/false);
}

at::Tensor reshard(const at::Tensor& t, const DeviceMesh& mesh, Placement to, const char* fn) {
  checkOneDim(mesh, fn);
  TORCH_CHECK(is_dtensor(t), fn, ": expects a DTensor output, got a plain tensor ", t.sizes(),
              ". Use it on modules whose output is a DTensor (use_local_output=false).");
  return redistribute(t, mesh, {to});
}

}  // namespace

void PairwiseParallel::apply(torch::nn::Module& module, const std::string& fqn, const DeviceMesh& mesh,
                             std::optional<int> src_data_rank) const {
  if (auto* attention = module.as<nn::MultiheadAttentionImpl>()) {
    attention->shard_heads(mesh, src_data_rank, fqn);
    return;
  }
  TORCH_CHECK(module.as<torch::nn::MultiheadAttentionImpl>() == nullptr, "PairwiseParallel: the module at '",
              fqn, "' is a torch::nn::MultiheadAttention, whose forward cannot run split heads. Declare it as "
              "dtp::nn::MultiheadAttention (same options, fields and forward).");
  const auto children = module.named_children();
  bool linears = children.size() == 2;
  for (const auto& c : children) linears &= c.value()->as<torch::nn::LinearImpl>() != nullptr;
  TORCH_CHECK(linears, "PairwiseParallel: the module at '", fqn, "' (", module.name(),
              ") must have exactly two nn::Linear children; it has ", children.size(),
              " children. Plan ColwiseParallel/RowwiseParallel per submodule instead.");
  parallelize_module(module, mesh, {{children[0].key(), ColwiseParallel()},
                                    {children[1].key(), RowwiseParallel()}}, src_data_rank);
}

at::Tensor make_input_replicate_1d(const at::Tensor& input, const DeviceMesh& mesh) {
  return inLayout(input, mesh, Replicate(), "make_input_replicate_1d");
}
at::Tensor make_input_shard_1d(const at::Tensor& input, const DeviceMesh& mesh, int64_t dim) {
  return inLayout(input, mesh, Shard(dim), "make_input_shard_1d");
}
at::Tensor make_input_shard_1d_last_dim(const at::Tensor& input, const DeviceMesh& mesh) {
  return inLayout(input, mesh, Shard(-1), "make_input_shard_1d_last_dim");
}
at::Tensor make_input_reshard_replicate(const at::Tensor& input, const DeviceMesh& mesh) {
  return redistribute(inLayout(input, mesh, Shard(0), "make_input_reshard_replicate"), mesh, {Replicate()});
}
at::Tensor make_output_replicate_1d(const at::Tensor& output, const DeviceMesh& mesh) {
  return reshard(output, mesh, Replicate(), "make_output_replicate_1d");
}
at::Tensor make_output_shard_1d(const at::Tensor& output, const DeviceMesh& mesh, int64_t dim) {
  return reshard(output, mesh, Shard(dim), "make_output_shard_1d");
}
at::Tensor make_output_tensor(const at::Tensor& output, const DeviceMesh& mesh) {
  return to_local(reshard(output, mesh, Replicate(), "make_output_tensor"));
}
at::Tensor make_output_reshard_tensor(const at::Tensor& output, const DeviceMesh& mesh) {
  return to_local(reshard(output, mesh, Shard(0), "make_output_reshard_tensor"));
}

bool enable_2d_with_fsdp() { return true; }

}  // namespace dtp
