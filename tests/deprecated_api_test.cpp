// The previous release's spellings, kept for one release (CHANGELOG.md's
// deprecation policy), compile and behave: this file builds as a user's
// program does, without DTP_NO_DEPRECATED.
#undef DTP_NO_DEPRECATED
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

#include "dist.h"

#include "dtp/nn/modules.h"

#include <gtest/gtest.h>

namespace {

// An output hook taking at::Tensor& (before NOTE: [Forward slots]) still
// converts for a forward with one tensor output, and refuses several.
TEST(DeprecatedApi, OutputHookTakingOneTensor) {
  dtp::nn::Linear lin(4, 3);
  at::Tensor seen;
  lin->post_hooks.push_back([&](at::Tensor& out) {
    seen = out.clone();
    out = out * 2;
  });
  const at::Tensor x = at::ones({2, 4});
  at::Tensor y = lin(x);
  ASSERT_TRUE(seen.defined());
  EXPECT_TRUE(y.equal(seen * 2));

  dtp::nn::PostHook old_form([](at::Tensor&) {});
  dtp::nn::Slots two;
  two.add(at::ones({1}), dtp::nn::SlotKind::kTensor);
  two.add(at::ones({1}), dtp::nn::SlotKind::kTensor);
  dtp::test::expect_error([&] { old_form(two); }, {"an output hook taking at::Tensor& needs a forward returning one tensor",
                                                   "returns 2 outputs"});
}

}  // namespace
