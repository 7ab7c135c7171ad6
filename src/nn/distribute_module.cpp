#include "dtp/distribute_module.h"

#include "dtensor/rules_agree.h"
#include "dtp/dtensor.h"
#include "dtp/module_utils.h"
#include "dtp/nn/hooked.h"

#include <torch/nn/module.h>

namespace dtp {

void distribute_module(torch::nn::Module& module, const DeviceMesh& mesh, PartitionFn partition_fn,
                       InputFn input_fn, OutputFn output_fn) {
  TORCH_CHECK(mesh.valid(), "distribute_module: invalid DeviceMesh. Build one with init_device_mesh.");
  check_sharding_rules_agree(mesh, "distribute_module");  // NOTE: [Ranks agree on sharding rules]
  for (const auto& item : module.named_modules("", /*include_self=*/true)) {
    torch::nn::Module& sub = *item.value();
    if (partition_fn) partition_fn(item.key(), sub, mesh);
    for (const auto& p : sub.named_parameters(/*recurse=*/false)) {
      if (is_dtensor(p.value())) continue;
      at::Tensor local = p.value().detach().requires_grad_(p.value().requires_grad());
      set_parameter(sub, p.key(), distribute_tensor(local, mesh, Placements(mesh.ndim(), Replicate())));
    }
  }
  if (!input_fn && !output_fn) return;
  auto* host = dynamic_cast<nn::HookHost*>(&module);
  TORCH_CHECK(host != nullptr, "distribute_module: input_fn/output_fn need hooks, but the root "
              "module (", module.name(), ") cannot run them. Hold it in a dtp::nn::Hooked "
              "holder: declare it with DTP_MODULE instead of TORCH_MODULE, or use dtp::nn::Linear.");
  if (input_fn) host->pre_hooks.push_back([input_fn, mesh](std::vector<at::Tensor>& in) { input_fn(in, mesh); });
  if (output_fn) {
    host->post_hooks.push_back([output_fn, mesh, type = module.name()](nn::Slots& out) {
      TORCH_CHECK(out.size() == 1 && out.is_tensor(0), "distribute_module: output_fn takes one at::Tensor, but the "
                  "forward of ", type, " returns ", out.size(), " outputs. Prepare several outputs with "
                  "PrepareModuleOutput (one layout per output) instead.");
      output_fn(out[0], mesh);
    });
  }
}

}  // namespace dtp
