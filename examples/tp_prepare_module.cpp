// PyTorch's PrepareModuleInput / PrepareModuleOutput examples, in C++: a
// TransformerBlock whose "attn" takes (x, mask, freqs) and returns
// (out, weights). Run: dtprun -n 2 tp_prepare_module
//
//   Python                                           C++
//   PrepareModuleInput(                              PrepareModuleInput(PrepareModuleInputOptions()
//     input_layouts=(Shard(0), None, None),            .input_layouts({Shard(0), std::nullopt, std::nullopt})
//     desired_input_layouts=(Replicate(), None, None))  .desired_input_layouts({Replicate(), std::nullopt, std::nullopt}))
//   PrepareModuleOutput(                             PrepareModuleOutput(PrepareModuleOutputOptions()
//     output_layouts=Replicate(),                      .output_layouts(Replicate())
//     desired_output_layouts=Shard(0))                 .desired_output_layouts(Shard(0)))
#include <dtp/dtensor.h>
#include <dtp/nn/modules.h>
#include <dtp/tp/parallelize.h>

#include <iostream>
#include <tuple>

struct AttentionImpl : torch::nn::Module {
  DTP_FORWARD_ARGS("x", "mask", "freqs");  // names for input_kwarg_layouts
  dtp::nn::Linear wq{register_module("wq", dtp::nn::Linear(8, 8))};
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& mask, double freqs) {
    at::Tensor q = wq(x) * freqs;
    at::Tensor weights = at::softmax(q.matmul(x.t()) + mask, -1);
    return {weights.matmul(x), weights};
  }
};
DTP_MODULE(Attention);

struct TransformerBlockImpl : torch::nn::Module {
  Attention attn{register_module("attn", Attention())};
  at::Tensor forward(const at::Tensor& x, const at::Tensor& mask) { return at::gelu(std::get<0>(attn(x, mask, 0.5))); }
};
DTP_MODULE(TransformerBlock);

int main() {
  dtp::init_process_group();
  auto tp_mesh = dtp::init_device_mesh("cpu", {2}, {"tp"});
  const int rank = tp_mesh.get_local_rank();
  at::manual_seed(0);  // the same weights and data on every rank
  TransformerBlock block, reference;
  reference->to(at::kDouble);
  block->to(at::kDouble);
  {
    torch::NoGradGuard no_grad;
    for (auto& p : block->named_parameters()) p.value().copy_(reference->named_parameters()[p.key()]);
  }
  const at::Tensor x = at::randn({6, 8}, at::kDouble), mask = at::zeros({6, 6}, at::kDouble);

  // attn's first argument arrives as this rank's rows (Shard(0)) and is
  // gathered; mask and freqs are left alone. The block's output is
  // replicated and handed back as this rank's rows.
  dtp::parallelize_module(*block, tp_mesh, {
      {"attn", dtp::PrepareModuleInput(dtp::PrepareModuleInputOptions()
                                           .input_layouts({dtp::Shard(0), std::nullopt, std::nullopt})
                                           .desired_input_layouts({dtp::Replicate(), std::nullopt, std::nullopt})
                                           .use_local_output(true))},
      {"", dtp::PrepareModuleOutput(dtp::PrepareModuleOutputOptions()
                                        .output_layouts(dtp::Replicate())
                                        .desired_output_layouts(dtp::Shard(0)))},
  });
  at::Tensor out = block(x.chunk(2, 0)[rank], mask);
  at::Tensor expected = reference(x, mask).chunk(2, 0)[rank];
  const double diff = (out - expected).abs().max().item<double>();
  std::cout << "block output " << out.sizes() << " (rows of rank " << rank << "), " << (diff == 0.0 ? "matches one device" : "DIFFERS from one device") << " (max |difference| "
            << diff << ")\n";
  return diff == 0.0 ? 0 : 1;
}
