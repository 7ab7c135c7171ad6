// The 2023 API (PairwiseParallel, make_input_*/make_output_*) against one
// device, as in PyTorch's older test_tp_examples / test_parallelize_api.
#include "dist.h"
#include "parity.h"

#include "dtp/comm_counter.h"
#include "dtp/dtensor.h"
#include "dtp/nn/modules.h"
#include "dtp/parallel/legacy.h"
#include "dtp/parallel/parallelize.h"

using namespace dtp;
using dtp::test::data;
using dtp::test::run_ranks;

namespace {

struct MlpImpl : torch::nn::Module {
  dtp::nn::Linear fc1{register_module("fc1", dtp::nn::Linear(6, 8))};
  dtp::nn::Linear fc2{register_module("fc2", dtp::nn::Linear(8, 6))};
  at::Tensor forward(const at::Tensor& x) { return fc2(at::relu(fc1(x))); }
};
DTP_MODULE(Mlp);

TEST(TpLegacyTest, PairwiseParallelIsColwiseThenRowwise) {
  for (int w : {2, 4}) {
    run_ranks(w, [&](int) {
      auto mesh = init_device_mesh("cpu", {w});
      Mlp m, ref;
      {
        torch::NoGradGuard g;
        for (auto& p : m->named_parameters()) {
          p.value().copy_(data(p.value().sizes().vec(), p.key().size()).to(at::kFloat));
          ref->named_parameters()[p.key()].copy_(p.value());
        }
      }
      parallelize_module(*m, mesh, PairwiseParallel());
      EXPECT_EQ(placements(m->fc1->weight), Placements{Shard(0)});
      EXPECT_EQ(placements(m->fc2->weight), Placements{Shard(1)});
      at::Tensor x = data({5, 6}).to(at::kFloat);
      CommCounter fwd;
      at::Tensor y = m(x);
      EXPECT_EQ(fwd.count(CollectiveType::AllReduce), 1) << fwd.str();
      EXPECT_EQ(fwd.total_count(), 1) << fwd.str();
      at::Tensor ry = ref(x);
      EXPECT_TRUE(y.allclose(ry, 1e-5, 1e-5));
      y.sum().backward();
      ry.sum().backward();
      for (const auto& p : ref->named_parameters())
        EXPECT_TRUE(full_tensor(m->named_parameters()[p.key()].grad()).allclose(p.value().grad(), 1e-5, 1e-5))
            << p.key();
    });
  }
}

TEST(TpLegacyTest, PairwiseParallelNeedsTwoLinears) {
  run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2});
    dtp::nn::Linear lin(4, 4);
    dtp::test::expect_error([&] { parallelize_module(*lin, mesh, PairwiseParallel()); },
                            {"PairwiseParallel", "exactly two nn::Linear"});
  });
}

TEST(TpLegacyTest, MakeInputAndOutputHelpers) {
  run_ranks(2, [&](int rank) {
    auto mesh = init_device_mesh("cpu", {2});
    at::Tensor full = data({4, 6});
    at::Tensor rows = full.chunk(2, 0)[rank], cols = full.chunk(2, 1)[rank];
    EXPECT_TRUE(full_tensor(make_input_shard_1d(rows, mesh)).equal(full));
    EXPECT_TRUE(full_tensor(make_input_shard_1d_last_dim(cols, mesh)).equal(full));
    EXPECT_EQ(placements(make_input_replicate_1d(full, mesh)), Placements{Replicate()});
    at::Tensor r = make_input_reshard_replicate(rows, mesh);
    EXPECT_EQ(placements(r), Placements{Replicate()});
    EXPECT_TRUE(to_local(r).equal(full));
    at::Tensor s = distribute_tensor(full, mesh, {Shard(1)});
    EXPECT_TRUE(make_output_tensor(s, mesh).equal(full));
    EXPECT_TRUE(make_output_reshard_tensor(s, mesh).equal(rows));
    EXPECT_EQ(placements(make_output_shard_1d(s, mesh, 0)), Placements{Shard(0)});
    EXPECT_EQ(placements(make_output_replicate_1d(s, mesh)), Placements{Replicate()});
    dtp::test::expect_error([&] { make_output_tensor(full, mesh); }, {"make_output_tensor", "plain tensor"});
  });
}

}  // namespace
