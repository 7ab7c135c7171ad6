// NOTE: [Module tracking] (include/dtp/nn/hooked.h): identity autograd nodes
// around a hooked module tell CommCounter when the module's backward runs.
// The node on the output was recorded after the module's own nodes, so the
// backward runs it before them: it enters. The nodes on the inputs were
// recorded before them and run once the gradients of every path through the
// module have reached them: they leave. A module whose output takes no part
// in the loss never enters; leaving then does nothing. The nodes return
// views, so an in-place change of a tracked module's output or input is an
// error while a CommDebugMode is alive (libtorch forbids in-place changes of a
// custom function's view outputs).
#include "dtp/nn/hooked.h"

#include <torch/csrc/autograd/custom_function.h>

#include <atomic>

namespace dtp::nn::detail {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct EnterBackward : public torch::autograd::Function<EnterBackward> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t token, const std::string& fqn) {
    ctx->saved_data["token"] = token;
    ctx->saved_data["fqn"] = fqn;
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    CommCounter::enter_backward(ctx->saved_data["token"].toInt(), ctx->saved_data["fqn"].toStringRef());
    return {grads[0], at::Tensor(), at::Tensor()};
  }
};

struct LeaveBackward : public torch::autograd::Function<LeaveBackward> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t token) {
    ctx->saved_data["token"] = token;
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    CommCounter::leave_backward(ctx->saved_data["token"].toInt());
    return {grads[0], at::Tensor()};
  }
};

}  // namespace

int64_t nextModuleToken() {
  static std::atomic<int64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

at::Tensor markBackwardLeave(const at::Tensor& input, int64_t token) {
  if (!input.defined() || !input.requires_grad()) return input;
  return LeaveBackward::apply(input, token);
}

at::Tensor markBackwardEnter(const at::Tensor& output, int64_t token, const std::string& fqn) {
  if (!output.defined() || !output.requires_grad()) return output;
  return EnterBackward::apply(output, token, fqn);
}

}  // namespace dtp::nn::detail
