// dtp::models: the reference Llama's forward, causal on a prefix.
#include <dtp/models/llama.h>

#include <ATen/ATen.h>

#include <iostream>

int main() {
  dtp::models::LlamaConfig c;
  c.vocab_size = 64;
  c.dim = 32;
  c.n_layers = 1;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.max_seq_len = 16;
  c.dtype = at::kDouble;
  dtp::models::Llama model(c);
  const at::Tensor tokens = at::arange(6, at::kLong).view({1, 6});
  const at::Tensor logits = model->forward(tokens);
  const at::Tensor prefix = model->forward(tokens.slice(1, 0, 3));
  const bool ok = logits.sizes() == at::IntArrayRef{1, 6, 64} &&
                  at::allclose(prefix, logits.slice(1, 0, 3), /*rtol=*/1e-12, /*atol=*/1e-12);
  std::cout << "dtp::models: " << (ok ? "OK" : "FAILED") << ": logits " << logits.sizes() << "\n";
  return ok ? 0 : 1;
}
