// The reference Llama's attention under context parallelism (src/models/llama_cp.cpp).
#pragma once

#include "dtp/models/llama.h"

namespace dtp::models::detail {

// Rotary embeddings at the layout's global positions, then ring or
// all-to-all attention over a.context_parallel's group, causal. q [batch,
// S_local, heads, head_dim], k and v [batch, S_local, kv_heads, head_dim]
// -> [batch, S_local, heads * head_dim]. See NOTE: [Context parallelism in
// the Llama].
at::Tensor context_parallel_attention(const AttentionImpl& a, at::Tensor q, at::Tensor k, at::Tensor v);

}  // namespace dtp::models::detail
