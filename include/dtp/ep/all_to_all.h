// Differentiable all_to_all_single for expert parallelism's token dispatch
// and combine: the backward sends the gradients back the way the rows came
// (the same collective with the split sizes swapped), as torchtitan's
// all_to_all_single_autograd.
#pragma once

#include "dtp/process_group.h"

#include <ATen/core/Tensor.h>

#include <vector>

namespace dtp::ep {

// Rows of `input` (dim 0) to each rank of `group` by input_split_sizes;
// returns the rows received, output_split_sizes[r] of them from rank r, in
// rank order. See ProcessGroup::all_to_all_single.
at::Tensor all_to_all_single_autograd(const at::Tensor& input, const std::vector<int64_t>& output_split_sizes,
                                      const std::vector<int64_t>& input_split_sizes, const ProcessGroup& group);

}  // namespace dtp::ep
