// A program written against the release landed at 10df3d0 (2026-11-27, see
// CHANGELOG.md), built unchanged against today's installed headers and run
// on 4 ranks. Its middle is that release's README, "Data parallelism on a
// (dp, tp) mesh", word for word, with the apply_ac call of its "Activation
// checkpointing" table at its place (after TP, before FSDP). It includes
// what those tables named: the parallelizations from dtp/models/llama.h,
// which has since moved them to dtp/models/parallelize.h (NOTE: [Deprecated
// forwarding] in llama.h). Do not port it to the new API: it is the old one
// on purpose. When a release drops that forwarding, replace it with a
// program of the release before.
#include <dtp/models/llama.h>
#include <dtp/optim/adamw.h>

#include <cmath>
#include <iostream>

int main() {
  dtp::init_process_group();
  dtp::models::LlamaConfig config;
  config.vocab_size = 64;
  config.dim = 32;
  config.n_layers = 2;
  config.n_heads = 4;
  config.n_kv_heads = 2;
  config.ffn_hidden = 40;
  config.max_seq_len = 16;
  config.dtype = at::kDouble;
  const at::Tensor batch = at::remainder(at::arange(2 * 9, at::kLong) * 13, 64).view({2, 9});
  const at::Tensor tokens = batch.narrow(1, 0, 8), targets = batch.narrow(1, 1, 8);
  dtp::models::Llama one_device(config);
  const double want = dtp::models::llama_loss(one_device(tokens), targets).item<double>();

  // The README at 10df3d0:
  auto mesh = dtp::init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
  dtp::models::Llama model(config);
  dtp::models::apply_tensor_parallel(model, mesh);        // mesh["tp"]
  dtp::models::apply_ac(model, {dtp::ACMode::Selective, 1});
  dtp::models::apply_fsdp(model, mesh);                   // fully_shard per block, then the root
  // or: dtp::models::apply_ddp(model, mesh);             // replicate(*model, mesh)
  dtp::optim::AdamW opt(model->unique_parameters(), torch::optim::AdamWOptions(1e-3));
  // each dp rank trains its batch/dp rows; gradients are averaged over dp

  // Every dp rank trains the same rows here, so the loss is one device's.
  at::Tensor loss = dtp::models::llama_loss(model(tokens), targets);
  opt.zero_grad();
  loss.backward();
  opt.step();
  const double got = loss.item<double>();
  const bool ok = std::abs(got - want) <= 1e-12 * std::abs(want);
  std::cout << "release 10df3d0's API: " << (ok ? "OK" : "FAILED") << ": (dp, tp) = (2, 2) loss " << got
            << ", one device " << want << "\n";
  return ok ? 0 : 1;
}
