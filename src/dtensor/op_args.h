// Reading and rewriting the tensor arguments of a boxed ATen call: the one
// loop that the fallback, the propagator and the replicate fallback share.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>

#include <string>
#include <vector>

namespace dtp {

// "aten::add.Tensor": the name with its overload, as errors print it.
inline std::string op_name(const c10::OperatorHandle& op) {
  const auto& n = op.operator_name();
  return n.overload_name.empty() ? n.name : n.name + "." + n.overload_name;
}

// The argument a write-aliased return refers to (`self` of add_, `out` of
// an out= op), or -1.
inline int written_arg(const c10::FunctionSchema& schema, const c10::Argument& ret) {
  const auto& args = schema.arguments();
  for (size_t i = 0; i < args.size(); ++i)
    if (args[i].alias_info() != nullptr && *args[i].alias_info() == *ret.alias_info()) return static_cast<int>(i);
  return -1;
}

// Calls f(arg_index, tensor) for every Tensor argument and every element of
// a TensorList argument, in schema order.
template <class F>
void for_each_tensor_arg(const c10::IValue* args, size_t n, F&& f) {
  for (size_t i = 0; i < n; ++i) {
    if (args[i].isTensor()) {
      f(i, args[i].toTensor());
    } else if (args[i].isTensorList()) {
      for (const at::Tensor& t : args[i].toTensorList()) f(i, t);
    }
  }
}

// Replaces every Tensor argument and TensorList element t, in schema order,
// with f(t).
template <class F>
void map_tensor_args(c10::IValue* args, size_t n, F&& f) {
  for (size_t i = 0; i < n; ++i) {
    if (args[i].isTensor()) {
      args[i] = f(args[i].toTensor());
    } else if (args[i].isTensorList()) {
      std::vector<at::Tensor> l;
      for (const at::Tensor& t : args[i].toTensorList()) l.push_back(f(t));
      args[i] = std::move(l);
    }
  }
}

}  // namespace dtp
