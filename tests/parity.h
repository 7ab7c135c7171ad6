// Parity against a single device: run `f` on full tensors and on DTensors
// distributed with the given placements; compare outputs and input gradients.
#pragma once

#include "close.h"
#include "dtp/dtensor.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <functional>

namespace dtp::test {

// Deterministic, rank-independent data.
inline at::Tensor data(std::vector<int64_t> shape, double seed = 0.0) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return at::sin(at::arange(n, at::kDouble) * 0.731 + seed).view(shape);
}

using Fn = std::function<at::Tensor(const std::vector<at::Tensor>&)>;

inline void expect_parity(const DeviceMesh& mesh, const std::vector<at::Tensor>& fulls,
                          const std::vector<Placements>& pls, const Fn& f,
                          bool backward = true, double tol = 1e-10) {
  std::vector<at::Tensor> ref_in, dist_in;
  for (size_t i = 0; i < fulls.size(); ++i) {
    const bool grad = backward && at::isFloatingType(fulls[i].scalar_type());
    ref_in.push_back(fulls[i].detach().clone().requires_grad_(grad));
    dist_in.push_back(distribute_tensor(fulls[i].detach().clone().requires_grad_(grad), mesh, pls[i]));
  }
  at::Tensor ref = f(ref_in);
  at::Tensor out = f(dist_in);
  ASSERT_TRUE(is_dtensor(out)) << "output is not a DTensor";
  at::Tensor full = full_tensor(out);
  ASSERT_EQ(full.sizes(), ref.sizes());
  EXPECT_CLOSE(full, ref, tol, tol) << "forward differs; placements out "
                                            << to_string(placements(out));
  if (!backward || !ref.requires_grad()) return;
  at::Tensor g = data(ref.sizes().vec(), 0.5).to(ref.scalar_type());
  (ref * g).sum().backward();
  (full * g).sum().backward();
  for (size_t i = 0; i < fulls.size(); ++i) {
    if (!ref_in[i].requires_grad()) continue;
    ASSERT_TRUE(dist_in[i].grad().defined()) << "input " << i << " got no gradient";
    EXPECT_EQ(placements(dist_in[i].grad()), pls[i]) << "input " << i;
    EXPECT_CLOSE(full_tensor(dist_in[i].grad()), ref_in[i].grad(), tol, tol)
        << "gradient of input " << i << " differs";
  }
}

}  // namespace dtp::test
