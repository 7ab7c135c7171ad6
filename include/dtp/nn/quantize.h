// Weight-only storage of Linear layers for inference: bfloat16 / float16
// weights, or int8 weight-only quantization (llama.cpp's Q8_0, torchao's
// int8_weight_only), under any TP layout.
//
//   dtp::nn::to_weight_only(*model->output, dtp::nn::WeightOnlyOptions().dtype(at::kChar).group_size(32));
//   at::Tensor logits = model->output(h);   // h float32: reads the int8 rows once, computes in float32
//
// NOTE: [Weight-only linears] A converted Linear keeps its input's dtype for
// the computation (float32, or float64 for exact checks) and stores only its
// weight narrow:
//   bfloat16 / float16  weight[n, k] as is; y = x w^T computed on the
//                       widened values, so y is float math on the bf16 values.
//   int8 (kChar)        weight[n, k] = q[n, k] * scales[n, k / group_size],
//                       q in [-127, 127], scale = max|w| of its group / 127
//                       (float16 by default, NOTE: [Float16 scales]; or
//                       float32), q = round(w / scale): |w - q scale| <=
//                       scale / 2 per element. group_size 0: one scale per
//                       output row (scales [n]).
// Its forward is one op, dtp::weight_only_linear(x, w) or
// dtp::int8_weight_only_linear(x, w, scales), whose CPU kernel widens the
// narrow rows in registers (a matrix-vector product for up to 8 rows of x,
// reading the weight once; blocks of 64 rows widened into a buffer and
// multiplied with ATen's mm above that), never a float copy of the whole
// weight. The bias (kept in the model's dtype) is added after.
//
// Under TP the weight keeps its DTensor placements and the scales follow
// the rows they scale: per mesh dimension, weight S(0) (colwise) -> scales
// S(0); weight S(1) (rowwise) -> scales S(1) per group (each rank's width
// must be a multiple of group_size: else an error naming the layer), R per
// row (the row maxima are reduced over the ranks holding the row's pieces,
// so the scales equal one device's); weight R -> scales R. The ops' sharding
// rule (colwise: x R -> y S(-1); rowwise: x S(-1) -> y P(sum); x sharded on
// a batch dim with a replicated weight) lets the TP plans run unchanged.
// Inference only: the ops have no backward, and a converted weight does not
// require grad.
//
// NOTE: [Float16 scales] int8 scales are float16 unless asked otherwise, as
// in Q8_0's blocks: 34 bytes per 32 weights instead of 36, the bytes a
// decode step reads. The scale is max|w| / 127 rounded up to a float16, so
// |w| / scale <= 127 (nothing clamps, float16's subnormals included) and
// |w - q scale| <= scale / 2 holds for the stored scale, which is at most
// 1 + 2^-10 times max|w| / 127 where float16 is normal. A weight whose
// scale would overflow float16 (|w| > 127 * 65504) is an error naming the
// layer; scale_dtype(at::kFloat) keeps float32 scales (rounded to nearest).
// The kernel widens a weight row's float16 scales to float32 (F16C) before
// its dot products, so the arithmetic is the float32 scales' on the stored
// values.
#pragma once

#include "dtp/nn/modules.h"

#include <c10/core/ScalarType.h>
#include <torch/arg.h>

#include <string>

namespace dtp::nn {

struct WeightOnlyOptions {
  // bfloat16, float16, or int8 (at::kChar: weight-only quantization).
  TORCH_ARG(c10::ScalarType, dtype) = c10::ScalarType::Char;
  // int8: inputs per scale along each row (32: Q8_0's blocks); 0: one scale
  // per output row (torchao's int8_weight_only).
  TORCH_ARG(int64_t, group_size) = 32;
  // int8: the scales' dtype, float16 (Q8_0's, NOTE: [Float16 scales]) or
  // float32.
  TORCH_ARG(c10::ScalarType, scale_dtype) = c10::ScalarType::Half;
};

// The options a command line names: "bfloat16" / "bf16", "float16" / "fp16"
// or "int8"; anything else is an error listing these.
WeightOnlyOptions weight_only_options(const std::string& name, int64_t group_size = 32);

// Converts `linear`'s weight (float, plain or DTensor; already set) in
// place: narrowed, or quantized with its scales registered as the buffer
// "weight_scales" (a DTensor beside a DTensor weight, placed per NOTE:
// [Weight-only linears]). `fqn` names the layer in errors. Collective over
// the ranks sharing a row only for int8 with group_size 0 under a rowwise
// (S(1)) weight; otherwise none.
void to_weight_only(HookedImpl<torch::nn::LinearImpl>& linear, const WeightOnlyOptions& options,
                    const std::string& fqn = "linear");

// weight_only_linear(x, weight, scales, bias), the forward of a converted
// Linear, is declared in dtp/nn/modules.h.

// The weight a converted Linear computes with, widened to `dtype` (plain or
// DTensor as stored): q * scales for int8. For checks and tests.
at::Tensor dequantized_weight(const HookedImpl<torch::nn::LinearImpl>& linear,
                              c10::ScalarType dtype = c10::ScalarType::Double);

}  // namespace dtp::nn
