// The reference Llama sizes dtp-bench runs.
#pragma once

#include "dtp/models/llama.h"

#include <cstdint>

namespace dtp::bench {

struct Size {
  const char* name;
  int64_t dim, layers, heads, kv_heads, batch, seq;

  models::LlamaConfig config() const {
    models::LlamaConfig c;
    c.dim = dim;
    c.n_layers = layers;
    c.n_heads = heads;
    c.n_kv_heads = kv_heads;
    c.max_seq_len = seq;
    c.seed = 1;
    return c;
  }
};

// tiny is for the smoke test; small is overhead-bound, large matmul-bound.
inline constexpr Size kSizes[] = {{"tiny", 32, 1, 2, 2, 2, 8},
                                  {"small", 64, 2, 4, 2, 8, 64},
                                  {"medium", 256, 4, 8, 4, 8, 128},
                                  {"large", 512, 4, 8, 4, 8, 256}};

}  // namespace dtp::bench
