// The previous release's spellings, kept for one release (CHANGELOG.md's
// deprecation policy), compile and behave: this file builds as a user's
// program does, without DTP_NO_DEPRECATED.
#undef DTP_NO_DEPRECATED
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

#include "dist.h"
#include "llama_util.h"

#include "dtp/models/generate.h"
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

// generate taking a KVCache (before NOTE: [generate on the engine]): the
// cache still bounds the call, with its errors, and the tokens are the new
// form's.
TEST(DeprecatedApi, GenerateTakingAKvCache) {
  dtp::models::LlamaConfig c = dtp::test::small_llama_config(/*tp=*/4);  // generate_test's model
  c.max_seq_len = 32;
  c.seed = 3;
  c.dtype = at::kDouble;
  dtp::models::Llama model(c);
  dtp::models::KVCache cache(2, 8);
  dtp::models::GenerateOptions o;
  o.max_new_tokens = 4;
  dtp::test::expect_error([&] { dtp::models::generate(model, cache, {{1, 2, 3, 4, 5, 6}}, o); },
                          {"the longest prompt (6 tokens) plus max_new_tokens=4 needs 9 cached positions",
                           "holds 8 (max_seq)"});
  dtp::test::expect_error([&] { dtp::models::generate(model, cache, {{1}, {2}, {3}}, o); },
                          {"a batch of 3 sequences", "holds 2 (max_batch)"});
  const std::vector<std::vector<int64_t>> prompts = {{5, 9, 2}, {1, 2}};
  EXPECT_EQ(dtp::models::generate(model, cache, prompts, o), dtp::models::generate(model, prompts, o));
}

}  // namespace
