// The MoE layers of a model, in block order (none for a dense model).
#pragma once

#include "dtp/models/llama.h"

#include <vector>

namespace dtp::models::detail {

std::vector<MoEImpl*> moe_layers(Llama& model);

// HF's load-balancing loss from this rank's sums over its layers and
// tokens: routed slots [top_k, E], the token count [1] and the router
// probabilities' sums [E]. Sums routed and tokens over `data_parallel` and
// the cp group (NOTE: [Load-balancing loss under context parallelism] in
// llama_ep.cpp); returns this rank's term (0-dim, the model's dtype) and
// d term / d probs[t, e] for every token t (per_prob [E], NOTE:
// [Load-balancing loss gradient]).
struct LoadBalancing {
  at::Tensor value, per_prob;
};
LoadBalancing load_balancing(const LlamaConfig& c, at::Tensor routed, at::Tensor tokens, const at::Tensor& prob_sums,
                             const std::optional<ProcessGroup>& data_parallel, const ContextParallelState* cp);

}  // namespace dtp::models::detail
