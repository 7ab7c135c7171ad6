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

namespace {

// NOTE: [PairwiseParallel's search] As PyTorch 2.0's parallelize_module with
// PairwiseParallel: a MultiheadAttention has its heads split; a module with
// two or more direct nn::Linear children is an MLP, whose Linears pair up in
// registration order (Colwise, Rowwise; an odd last one stays as it is);
// any other module hands the style to each child, so pairs deeper down are
// found. Returns how many MLPs and attentions it parallelized.
int pairwise(torch::nn::Module& module, const std::string& fqn, const DeviceMesh& mesh,
             std::optional<int> src_data_rank, const PairwiseParallel& style, const std::string& name) {
  if (auto* attention = module.as<nn::MultiheadAttentionImpl>()) {
    TORCH_CHECK(style.input_layout().is_replicate() && style.output_layout().is_replicate(), name, ": the module at '",
                fqn, "' is a MultiheadAttention. NYI: sequence-sharded attention in the 2023 API; use PairwiseParallel "
                "for it, with make_input_reshard_replicate / make_output_reshard_tensor around the block.");
    attention->shard_heads(mesh, src_data_rank, fqn);
    return 1;
  }
  if (module.as<torch::nn::MultiheadAttentionImpl>() != nullptr) {
    const std::string field = fqn.substr(fqn.rfind('.') == std::string::npos ? 0 : fqn.rfind('.') + 1);
    TORCH_CHECK(false, name, ": the module at '", fqn, "' is a stock torch::nn::MultiheadAttention, whose forward "
                "cannot run split heads, and C++ calls a field's own forward, so dtp cannot swap it in place. In the "
                "parent module, declare the field as `dtp::nn::MultiheadAttention ", field.empty() ? "attn" : field,
                "{nullptr};` (dtp/nn/multihead_attention.h: same options, fields and forward) instead of "
                "`torch::nn::MultiheadAttention`.");
  }
  std::vector<std::string> linears;
  for (const auto& c : module.named_children())
    if (c.value()->as<torch::nn::LinearImpl>() != nullptr) linears.push_back(c.key());
  if (linears.size() >= 2) {
    const size_t pairs = linears.size() / 2;
    ParallelizePlan plan;
    for (size_t i = 0; i < pairs; ++i) {
      ColwiseParallelOptions col;
      RowwiseParallelOptions row;
      if (i == 0) col.input_layouts(style.input_layout());
      if (i + 1 == pairs) row.output_layouts(style.output_layout());
      plan.emplace_back(linears[2 * i], ColwiseParallel(col));
      plan.emplace_back(linears[2 * i + 1], RowwiseParallel(row));
    }
    parallelize_module(module, mesh, plan, src_data_rank);
    return 1;
  }
  int found = 0;
  for (const auto& c : module.named_children())
    found += pairwise(*c.value(), fqn.empty() ? c.key() : fqn + "." + c.key(), mesh, src_data_rank, style, name);
  return found;
}

}  // namespace

void PairwiseParallel::apply(torch::nn::Module& module, const std::string& fqn, const DeviceMesh& mesh,
                             std::optional<int> src_data_rank) const {
  TORCH_CHECK(pairwise(module, fqn, mesh, src_data_rank, *this, name()) > 0, name(), ": the module at '", fqn, "' (",
              module.name(), ") holds no MLP (a module with two or more nn::Linear children) and no "
              "dtp::nn::MultiheadAttention at any depth. Plan ColwiseParallel/RowwiseParallel per submodule instead.");
}

legacy::SequenceParallel::SequenceParallel() : PairwiseParallel(Shard(0), Shard(0)) {}

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
