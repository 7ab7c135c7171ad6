#include "dtp/ep/all_to_all.h"

#include <torch/csrc/autograd/custom_function.h>
#include <torch/custom_class.h>

namespace dtp::ep {
namespace {

// The group, held by the autograd context until backward.
struct GroupHolder : torch::CustomClassHolder {
  explicit GroupHolder(ProcessGroup g) : group(std::move(g)) {}
  ProcessGroup group;
};

struct AllToAllSingle : public torch::autograd::Function<AllToAllSingle> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input,
                            std::vector<int64_t> output_split_sizes, std::vector<int64_t> input_split_sizes,
                            ProcessGroup group) {
    ctx->saved_data["out"] = c10::List<int64_t>(output_split_sizes);
    ctx->saved_data["in"] = c10::List<int64_t>(input_split_sizes);
    ctx->saved_data["group"] = c10::IValue::make_capsule(c10::make_intrusive<GroupHolder>(group));
    return group.all_to_all_single(input, output_split_sizes, input_split_sizes).wait();
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto out = ctx->saved_data["out"].toIntVector(), in = ctx->saved_data["in"].toIntVector();
    const ProcessGroup group =
        c10::static_intrusive_pointer_cast<GroupHolder>(ctx->saved_data["group"].toCapsule())->group;
    // The rows came in by `out` from each rank: their gradients go back so.
    at::Tensor g = group.all_to_all_single(grads[0].contiguous(), in, out).wait();
    return {g, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor all_to_all_single_autograd(const at::Tensor& input, const std::vector<int64_t>& output_split_sizes,
                                      const std::vector<int64_t>& input_split_sizes, const ProcessGroup& group) {
  return AllToAllSingle::apply(input, output_split_sizes, input_split_sizes, group);
}

}  // namespace dtp::ep
