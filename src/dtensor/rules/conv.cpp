// Convolutions (conv1d/2d/3d reach aten::convolution and, in backward,
// aten::convolution_backward). With input [N, C_in, ...] and weight
// [C_out, C_in / groups, ...]:
//  - batch-sharded: input S(0), weight and bias R -> output S(0); the weight
//    and bias gradients are partial sums over the batch, P(sum);
//  - in-channel-sharded (groups 1): input S(1), weight S(1) -> output
//    P(sum), each rank convolving its channels; the bias joins as P(sum)
//    (a local change of a replicated bias: added once in the sum);
//  - out-channel-sharded (groups 1): weight and bias S(0), input R -> output
//    S(1); the input gradient is a partial sum over output channels, P(sum);
//  - all replicated.
// Transposed convolutions and groups > 1 shard the batch only.
#include "dtensor/rules/common.h"

#include <ATen/ATen.h>

namespace dtp {
namespace {

using rules::replicate_row;

// Whether channels may shard: not transposed, one group (the arguments'
// positions differ between the two ops).
bool channelShardable(const OpCall& call, int transposed_arg, int groups_arg) {
  return !call.args[transposed_arg].toBool() && call.args[groups_arg].toInt() == 1;
}

// convolution(input, weight, bias?, stride, padding, dilation, transposed,
// output_padding, groups)
std::vector<Row> convolutionRows(const OpCall& call, int64_t) {
  const bool bias = call.slot_of_arg(2) >= 0;
  auto row = [&](Placement input, Placement weight, Placement b, Placement out) {
    Row r{{input, weight}, {out}};
    if (bias) r.in.push_back(b);
    return r;
  };
  std::vector<Row> rows{replicate_row(call), row(Shard(0), Replicate(), Replicate(), Shard(0))};
  if (channelShardable(call, 6, 8)) {
    rows.push_back(row(Shard(1), Shard(1), Partial(), Partial()));
    rows.push_back(row(Replicate(), Shard(0), Shard(0), Shard(1)));
  }
  return rows;
}

// convolution_backward(grad_output, input, weight, bias_sizes?, stride,
// padding, dilation, transposed, output_padding, groups, output_mask)
// -> (grad_input, grad_weight, grad_bias)
std::vector<Row> convolutionBackwardRows(const OpCall& call, int64_t) {
  std::vector<Row> rows{replicate_row(call), {{Shard(0), Shard(0), Replicate()}, {Shard(0), Partial(), Partial()}}};
  if (channelShardable(call, 7, 9)) {
    rows.push_back({{Replicate(), Shard(1), Shard(1)}, {Shard(1), Shard(1), Replicate()}});
    rows.push_back({{Shard(1), Replicate(), Shard(0)}, {Partial(), Shard(0), Shard(0)}});
  }
  return rows;
}

// libtorch has no Meta kernel for convolution: the output shape by formula.
// List arguments of one element apply to every spatial dim.
OutputMeta convolutionShape(const OpCall& call) {
  const auto& in = call.spec(0).shape;
  const auto& w = call.spec(1).shape;
  const auto stride = call.args[3].toIntVector(), padding = call.args[4].toIntVector(),
             dilation = call.args[5].toIntVector(), output_padding = call.args[7].toIntVector();
  const bool transposed = call.args[6].toBool();
  const int64_t groups = call.args[8].toInt();
  auto at = [](const std::vector<int64_t>& v, size_t i) { return v.size() == 1 ? v[0] : v[i]; };
  std::vector<int64_t> out{in[0], transposed ? w[1] * groups : w[0]};
  for (size_t d = 2; d < in.size(); ++d) {
    const size_t i = d - 2;
    const int64_t span = at(dilation, i) * (w[d] - 1);
    out.push_back(transposed ? (in[d] - 1) * at(stride, i) - 2 * at(padding, i) + span + at(output_padding, i) + 1
                             : (in[d] + 2 * at(padding, i) - span - 1) / at(stride, i) + 1);
  }
  return OutputMeta{{out}, {call.spec(0).dtype}};
}

// Shaped like input, weight and bias; an output the mask turns off is
// undefined.
OutputMeta convolutionBackwardShape(const OpCall& call) {
  const auto mask = call.args[10].toBoolList();
  const auto bias = call.args[3].isNone() ? std::vector<int64_t>{call.spec(2).shape[0]} : call.args[3].toIntVector();
  const std::vector<std::vector<int64_t>> shapes{call.spec(1).shape, call.spec(2).shape, bias};
  OutputMeta m;
  for (size_t i = 0; i < 3; ++i) {
    m.shapes.push_back(shapes[i]);
    m.dtypes.push_back(mask[i] ? call.spec(0).dtype : c10::ScalarType::Undefined);
  }
  return m;
}

// ATen refuses a weight with no channels, which an uneven channel shard
// leaves on some ranks (6 channels on 4 ranks: 2, 2, 2, 0). A rank with an
// empty input or weight shard contributes zeros of its output shard's size
// (and its share of the bias); else the kernel runs.
void convolutionLocal(const c10::OperatorHandle& op, torch::jit::Stack* stack, const Decision& d) {
  const size_t n = op.schema().arguments().size();
  const c10::IValue* args = &*(stack->end() - static_cast<std::ptrdiff_t>(n));
  const at::Tensor input = args[0].toTensor(), weight = args[1].toTensor();
  if (input.numel() > 0 && weight.numel() > 0) return op.callBoxed(stack);
  at::Tensor out = at::zeros(d.out[0]->local_sizes, input.options());
  if (!args[2].isNone() && out.numel() > 0) {
    std::vector<int64_t> shape(out.dim(), 1);
    shape[1] = -1;
    out.add_(args[2].toTensor().view(shape));
  }
  torch::jit::drop(*stack, n);
  stack->emplace_back(std::move(out));
}

// The same for the backward: zero input and weight gradients; the bias
// gradient is the local gradient's sum over all but the channel dim (whole,
// partial or a shard, as the row says).
void convolutionBackwardLocal(const c10::OperatorHandle& op, torch::jit::Stack* stack, const Decision& d) {
  const size_t n = op.schema().arguments().size();
  const c10::IValue* args = &*(stack->end() - static_cast<std::ptrdiff_t>(n));
  const at::Tensor grad = args[0].toTensor(), input = args[1].toTensor(), weight = args[2].toTensor();
  if (grad.numel() > 0 && input.numel() > 0 && weight.numel() > 0) return op.callBoxed(stack);
  std::vector<at::Tensor> out(3);
  for (size_t i = 0; i < 2; ++i)
    if (d.out[i]) out[i] = at::zeros(d.out[i]->local_sizes, grad.options());
  if (d.out[2]) {
    std::vector<int64_t> dims{0};
    for (int64_t k = 2; k < grad.dim(); ++k) dims.push_back(k);
    out[2] = grad.sum(dims).reshape(d.out[2]->local_sizes);
  }
  torch::jit::drop(*stack, n);
  for (auto& t : out) stack->emplace_back(std::move(t));
}

}  // namespace

void registerConvolutionRules(RuleRegistry& r) {
  r.add("aten::convolution", convolutionRows, convolutionShape, convolutionLocal);
  r.add("aten::convolution_backward", convolutionBackwardRows, convolutionBackwardShape, convolutionBackwardLocal);
}

}  // namespace dtp
