// ParallelDims (torchtitan's, dtp/parallel_dims.h): the degrees' validation,
// the mesh build_mesh makes (dimensions, flattened names, their groups), and
// parallelize_llama on it training exactly as on the hand-built mesh of the
// same layout; under expert parallelism every parameter lives on the user's
// mesh or a slice of it (NOTE: [Expert parallelism with data parallelism]).
#include "close.h"
#include "dist.h"
#include "llama_util.h"

#include "dtp/comm_counter.h"
#include "dtp/dtensor.h"
#include "dtp/fsdp/fully_shard.h"
#include "dtp/models/llama.h"
#include "dtp/models/moe.h"
#include "dtp/models/parallelize.h"
#include "dtp/parallel_dims.h"

#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <array>
#include <cstdio>
#include <map>
#include <mutex>
#include <set>

namespace {

using namespace dtp;
using namespace dtp::models;
using dtp::test::expect_error;
using dtp::test::run_ranks;
using Flat = std::vector<std::pair<std::string, std::vector<std::string>>>;
using Names = std::vector<std::string>;

// The reference Llama in float64, for runs compared against each other.
LlamaConfig denseConfig() {
  LlamaConfig c = dtp::test::small_llama_config(2);
  c.dtype = at::kDouble;
  return c;
}

// Mixtral-style: 4 experts, top 2.
LlamaConfig moeConfig() { return dtp::test::mixtral_like(denseConfig()); }

// Degrees -> torchtitan's mesh: names and sizes in its order, flattened names.
TEST(ParallelDimsTest, ValidLayoutsDescribeTorchtitansMesh) {
  {
    SCOPED_TRACE("HSDP x TP, dp_shard inferred");
    ParallelDims d = ParallelDims().dp_replicate(2).tp(2).world_size(8);
    EXPECT_EQ(d.validate().dp_shard(), 2);
    EXPECT_EQ(d.mesh_dim_names(), (Names{"dp_replicate", "dp_shard", "tp"}));
    EXPECT_EQ(d.mesh_shape(), (std::vector<int64_t>{2, 2, 2}));
    EXPECT_EQ(d.flattened_dims(), (Flat{{"dp", {"dp_replicate", "dp_shard"}},
                                        {"dp_shard_cp", {"dp_shard"}},
                                        {"dp_cp", {"dp_replicate", "dp_shard"}}}));
    EXPECT_TRUE(d.dp_enabled() && d.dp_replicate_enabled() && d.dp_shard_enabled() && d.fsdp_enabled() &&
                d.tp_enabled() && d.dp_cp_enabled());
    EXPECT_FALSE(d.cp_enabled() || d.pp_enabled() || d.ep_enabled());
    EXPECT_EQ(d.fsdp_gradient_divide_factor(), 4);
    EXPECT_EQ(d.non_data_parallel_size(), 2);
    EXPECT_EQ(d.seq_len_divisor(), 4);
  }
  {
    SCOPED_TRACE("pp x cp x tp: dp_shard inferred 1, no dp");
    ParallelDims d = ParallelDims().pp(2).cp(2).tp(2).world_size(8);
    d.validate();
    EXPECT_EQ(d.dp_shard(), 1);
    EXPECT_EQ(d.mesh_dim_names(), (Names{"pp", "cp", "tp"}));
    EXPECT_EQ(d.flattened_dims(), (Flat{{"dp_shard_cp", {"cp"}}, {"dp_cp", {"cp"}}}));
    EXPECT_FALSE(d.dp_enabled());
    EXPECT_TRUE(d.fsdp_enabled() && d.dp_cp_enabled());
    EXPECT_EQ(d.seq_len_divisor(), 8);
  }
  {
    SCOPED_TRACE("ep 2 borrowed from dp_shard 4, tp 2");
    ParallelDims d = ParallelDims().ep(2).tp(2).world_size(8);
    d.validate();
    EXPECT_EQ(d.dp_shard(), 4);
    EXPECT_EQ(d.mesh_dim_names(), (Names{"dp_shard_mod_ep", "dp_shard_in_ep", "tp"}));
    EXPECT_EQ(d.mesh_shape(), (std::vector<int64_t>{2, 2, 2}));
    const Names both = {"dp_shard_mod_ep", "dp_shard_in_ep"};
    EXPECT_EQ(d.flattened_dims(), (Flat{{"dp", both}, {"dp_shard_cp", both}, {"dp_cp", both}, {"ep", {"dp_shard_in_ep"}}}));
  }
  {
    SCOPED_TRACE("ep = dp_shard: dp_shard_mod_ep stays, of size 1");
    ParallelDims d = ParallelDims().ep(4).world_size(4);
    d.validate();
    EXPECT_EQ(d.mesh_dim_names(), (Names{"dp_shard_mod_ep", "dp_shard_in_ep"}));
    EXPECT_EQ(d.mesh_shape(), (std::vector<int64_t>{1, 4}));
  }
  {
    SCOPED_TRACE("ep 4 over dp_shard 2 x cp 2: ep = (dp_shard_in_ep, cp)");
    ParallelDims d = ParallelDims().dp_shard(2).cp(2).ep(4).world_size(4);
    d.validate();
    EXPECT_EQ(d.mesh_dim_names(), (Names{"dp_shard_mod_ep", "dp_shard_in_ep", "cp"}));
    EXPECT_EQ(d.mesh_shape(), (std::vector<int64_t>{1, 2, 2}));
    const Names dp = {"dp_shard_mod_ep", "dp_shard_in_ep"}, all = {"dp_shard_mod_ep", "dp_shard_in_ep", "cp"};
    EXPECT_EQ(d.flattened_dims(), (Flat{{"dp", dp}, {"dp_shard_cp", all}, {"dp_cp", all}, {"ep", {"dp_shard_in_ep", "cp"}}}));
  }
  {
    SCOPED_TRACE("ep = cp: dp_shard_in_ep stays, of size 1, naming expert parallelism on the mesh");
    ParallelDims d = ParallelDims().cp(2).ep(2).world_size(2);
    d.validate();
    EXPECT_EQ(d.mesh_dim_names(), (Names{"dp_shard_mod_ep", "dp_shard_in_ep", "cp"}));
    EXPECT_EQ(d.mesh_shape(), (std::vector<int64_t>{1, 1, 2}));
    EXPECT_EQ(d.flattened_dims().back(), (std::pair<std::string, Names>{"ep", {"dp_shard_in_ep", "cp"}}));
  }
  {
    SCOPED_TRACE("one rank");
    ParallelDims d = ParallelDims().world_size(1);
    d.validate();
    EXPECT_EQ(d.mesh_dim_names(), (Names{"dp_shard"}));
    EXPECT_EQ(d.mesh_shape(), (std::vector<int64_t>{1}));
    EXPECT_FALSE(d.dp_enabled());
  }
  {
    SCOPED_TRACE("every degree given");
    ParallelDims d = ParallelDims().pp(2).dp_replicate(2).dp_shard(2).tp(2).world_size(16);
    EXPECT_EQ(d.validate().mesh_dim_names(), (Names{"pp", "dp_replicate", "dp_shard", "tp"}));
  }
}

// Every invalid description fails naming the degrees and their product.
TEST(ParallelDimsTest, InvalidProductsAreNamed) {
  expect_error([] { ParallelDims().dp_replicate(2).dp_shard(3).tp(2).world_size(8).validate(); },
               {"ParallelDims: invalid parallel dims",
                "dp_replicate(2) * dp_shard(3) * cp(1) * tp(2) * pp(1) = 12 != WORLD_SIZE(8)", "dp_shard(-1)"});
  expect_error([] { ParallelDims().tp(3).world_size(8).validate(); },
               {"inferring dp_shard from WORLD_SIZE(8) / (dp_replicate(1) * cp(1) * tp(3) * pp(1)) = 8 / 3",
                "a multiple of 3"});
  expect_error([] { ParallelDims().tp(0).world_size(8).validate(); }, {"degree tp: got 0, expected >= 1"});
  expect_error([] { ParallelDims().dp_shard(-2).world_size(8).validate(); }, {"degree dp_shard: got -2"});
  expect_error([] { ParallelDims().validate(); }, {"world_size: got 0"});
  expect_error([] { ParallelDims().ep(3).world_size(4).validate(); },
               {"ep(3) borrows from dp_shard(4) * cp(1) = 4", "divide dp_shard * cp"});
  expect_error([] { ParallelDims().cp(2).ep(3).world_size(12).validate(); }, {"ep(3) borrows from dp_shard(6) * cp(2)"});
  expect_error([] { (void)ParallelDims().world_size(4).dp_shard_enabled(); },
               {"ParallelDims::dp_shard_enabled: dp_shard: got -1", "Call validate() first"});
  expect_error([] { (void)ParallelDims().world_size(4).mesh_dim_names(); }, {"ParallelDims::build_mesh"});
  // The mesh itself: init_device_mesh's world must match.
  run_ranks(4, [](int) {
    expect_error([] { ParallelDims().tp(2).world_size(8).build_mesh(); },
                 {"ParallelDims::build_mesh: world_size(8): got a world of 4 ranks, expected 8"});
  });
}

// build_mesh: the dimensions, and each flattened name a mesh over the ranks
// it covers with one group, registered with one agreement each (2
// all_gathers) on top of init_device_mesh's collectives.
TEST(ParallelDimsTest, BuildMeshRegistersTheFlattenedNames) {
  run_ranks(8, [](int rank) {
    int64_t plain = 0;
    {
      CommCounter plain_count;
      init_device_mesh("cpu", {2, 2, 2}, {"dp_replicate", "dp_shard", "tp"});
      plain = plain_count.count(CollectiveType::AllGather);
    }
    CommCounter count;
    const DeviceMesh mesh = ParallelDims().dp_replicate(2).tp(2).world_size(8).build_mesh("cpu");
    EXPECT_EQ(count.count(CollectiveType::AllGather) - plain, 2 * 3) << "dp, dp_shard_cp, dp_cp";
    EXPECT_EQ(mesh.mesh_dim_names(), (Names{"dp_replicate", "dp_shard", "tp"}));
    EXPECT_EQ(mesh.shape(), (std::vector<int64_t>{2, 2, 2}));
    // dp: the 4 ranks of my tp coordinate, row-major over (dp_replicate, dp_shard).
    const DeviceMesh dp = mesh["dp"];
    const int tp = rank % 2;
    EXPECT_EQ(dp.get_group().global_ranks(), (std::vector<int>{tp, 2 + tp, 4 + tp, 6 + tp}));
    EXPECT_EQ(dp.get_local_rank(), rank / 2);
    EXPECT_EQ(dp.get_root_mesh().id(), mesh.id());
    EXPECT_EQ(mesh["dp_cp"].get_group(), dp.get_group()) << "the same dimensions: one group";
    EXPECT_EQ(mesh["dp_shard_cp"].get_group(), mesh["dp_shard"].get_group());
    EXPECT_EQ((mesh[{"dp", "tp"}].shape()), (std::vector<int64_t>{4, 2}));
    EXPECT_EQ(data_parallel_group(mesh), dp.get_group());
    at::Tensor sum = at::full({1}, static_cast<double>(rank), at::kDouble);
    dp.get_group().all_reduce(sum).wait();
    EXPECT_EQ(sum.item<double>(), 12 + 4 * tp);

    // With ep, EP's flattened name covers the dimension it borrows.
    const DeviceMesh ep_mesh = ParallelDims().ep(2).tp(2).world_size(8).build_mesh("cpu");
    EXPECT_EQ(ep_mesh.mesh_dim_names(), (Names{"dp_shard_mod_ep", "dp_shard_in_ep", "tp"}));
    EXPECT_EQ(ep_mesh["ep"], ep_mesh["dp_shard_in_ep"]);
    EXPECT_EQ(ep_mesh["dp"].size(), 4);
    EXPECT_EQ(data_parallel_group(ep_mesh), ep_mesh["dp"].get_group());
    const ParallelMeshDims parts = parallel_mesh_dims(ep_mesh);
    EXPECT_EQ(parts.dp_shard.value_or("<none>"), "dp_shard_mod_ep");
    EXPECT_EQ(parts.ep.value_or("<none>"), "dp_shard_in_ep");
    EXPECT_EQ(parts.batch, (Names{"dp_shard_mod_ep", "dp_shard_in_ep"}));
  });
}

// What the mesh cannot do yet fails before anything changes.
TEST(ParallelDimsTest, ContextParallelAndUnsupportedLayoutsError) {
  const LlamaConfig c = denseConfig();
  const LlamaConfig moe = moeConfig();
  run_ranks(4, [&](int) {
    // cp on its own and with tp, dp: tests/cp_llama_test.cpp; with pp:
    // tests/cp_pipeline_test.cpp; with ep: tests/cp_moe_test.cpp.
    Llama model(c);
    // dp_replicate alone has nothing for FSDP to shard.
    const DeviceMesh ddp = ParallelDims().dp_replicate(2).dp_shard(1).tp(2).world_size(4).build_mesh();
    expect_error([&] { parallelize_llama(model, ddp); }, {"parallelize_llama", "no dimension to shard over", "DDP"});
    // Expert parallelism with HSDP.
    const DeviceMesh hsdp_ep = ParallelDims().dp_replicate(2).ep(2).world_size(4).build_mesh();
    EXPECT_EQ(hsdp_ep.mesh_dim_names(), (Names{"dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep"}));
    Llama experts(moe);
    expect_error([&] { parallelize_llama(experts, hsdp_ep); }, {"NYI: expert parallelism with HSDP"});
  });
}

constexpr int64_t kB = 8, kS = dtp::test::kSeq;

at::Tensor batchOf(int64_t vocab, int step) {
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(100 + step);
  return at::randint(vocab, {kB, kS + 1}, g, at::kLong);
}

struct TrainRun {
  std::vector<std::pair<std::string, at::Tensor>> params;  // full, after the last step
  std::array<int64_t, kNumCollectiveTypes> counts{};        // rank 0's, over the steps
};

// 3 AdamW steps, each data-parallel rank on its rows of the batch (with the
// load-balancing loss when the model has experts).
TrainRun train(Llama& model, const ProcessGroup& dp) {
  torch::optim::AdamW opt(model->unique_parameters(), torch::optim::AdamWOptions(1e-2));
  TrainRun run;
  CommCounter comm;
  for (int step = 0; step < 3; ++step) {
    at::Tensor batch = batchOf(model->config.vocab_size, step).narrow(0, dp.rank() * (kB / dp.size()), kB / dp.size());
    at::Tensor loss = llama_loss(model(batch.narrow(1, 0, kS)), batch.narrow(1, 1, kS));
    if (model->config.moe.num_experts > 0) loss = loss + moe_load_balancing_loss(model, dp);
    opt.zero_grad();
    loss.backward();
    opt.step();
  }
  for (size_t i = 0; i < kNumCollectiveTypes; ++i) run.counts[i] = comm.count(static_cast<CollectiveType>(i));
  run.params = dtp::test::full_named_params(model);
  return run;
}

double maxAbsDiff(const TrainRun& a, const TrainRun& b) {
  EXPECT_EQ(a.params.size(), b.params.size());
  double out = 0;
  for (size_t i = 0; i < std::min(a.params.size(), b.params.size()); ++i) {
    EXPECT_EQ(a.params[i].first, b.params[i].first);
    out = std::max(out, (a.params[i].second - b.params[i].second).abs().max().item<double>());
  }
  return out;
}

// Trains `c` with parallelize_llama on `make_mesh()` over `world` ranks;
// `check` sees each rank's model and mesh after parallelize_llama.
TrainRun trainOn(int world, const LlamaConfig& c, const std::function<DeviceMesh()>& make_mesh, DataParallel data_parallel,
            const std::function<void(Llama&, const DeviceMesh&)>& check = {}) {
  TrainRun out;
  std::mutex mu;
  run_ranks(world, [&](int rank) {
    const DeviceMesh mesh = make_mesh();
    Llama model(c);
    ParallelizeOptions options;
    options.tp = TensorParallelOptions{true, kS};
    options.data_parallel = data_parallel;
    parallelize_llama(model, mesh, options);
    if (check) check(model, mesh);
    TrainRun run = train(model, data_parallel_group(mesh));
    if (rank == 0) {
      std::lock_guard<std::mutex> lock(mu);
      out = std::move(run);
    }
  });
  return out;
}

// Same collectives, same values: a ParallelDims mesh is the hand-built one's
// layout under torchtitan's names. The runs do the same float64 operations
// over the same groups, so the weights agree to the last ulps at most.
void expectSameRun(const TrainRun& got, const TrainRun& want) {
  for (size_t i = 0; i < kNumCollectiveTypes; ++i)
    EXPECT_EQ(got.counts[i], want.counts[i]) << to_string(static_cast<CollectiveType>(i));
  EXPECT_GT(want.counts[static_cast<size_t>(CollectiveType::AllReduce)] +
                want.counts[static_cast<size_t>(CollectiveType::ReduceScatter)],
            0)
      << "data parallelism reduced the gradients";
  const double diff = maxAbsDiff(got, want);
  std::printf("  max |ParallelDims - hand-built| over the weights: %.3g\n", diff);
  EXPECT_LE(diff, 1e-13) << "max |ParallelDims run - hand-built run| over the weights after 3 steps";
}

TEST(ParallelDimsTest, MeshTrainsLlamaLikeTheHandBuiltMesh) {
  const LlamaConfig c = denseConfig();
  struct Layout {
    const char* what;
    int world;
    std::vector<int64_t> shape;
    Names names;
    ParallelDims dims;
    DataParallel dp;
  };
  const std::vector<Layout> layouts = {
      {"FSDP x TP: (dp, tp) vs (dp_shard, tp)", 4, {2, 2}, {"dp", "tp"}, ParallelDims().tp(2).world_size(4),
       DataParallel::FSDP},
      {"FSDP: (dp) vs (dp_shard)", 4, {4}, {"dp"}, ParallelDims().world_size(4), DataParallel::FSDP},
      {"HSDP x TP", 8, {2, 2, 2}, {"dp_replicate", "dp_shard", "tp"},
       ParallelDims().dp_replicate(2).tp(2).world_size(8), DataParallel::FSDP},
      {"DDP x TP: (dp, tp) vs (dp_replicate, tp)", 4, {2, 2}, {"dp", "tp"},
       ParallelDims().dp_replicate(2).dp_shard(1).tp(2).world_size(4), DataParallel::DDP},
  };
  for (const Layout& l : layouts) {
    SCOPED_TRACE(l.what);
    const TrainRun want = trainOn(l.world, c, [&] { return init_device_mesh("cpu", l.shape, l.names); }, l.dp);
    const TrainRun got = trainOn(l.world, c, [&] { return l.dims.build_mesh("cpu"); }, l.dp);
    expectSameRun(got, want);
  }
}

// Expert parallelism on the user's mesh: every parameter's DTensor mesh has
// the user's mesh as its root (the experts' (dp, ep) slice, the rest's
// (dp_shard_cp, tp) slice), on a hand-built (dp, ep[, tp]) mesh and on
// ParallelDims' (dp_shard_mod_ep, dp_shard_in_ep[, tp]) alike, which train
// the same.
TEST(ParallelDimsTest, ExpertParallelParametersLiveOnTheUsersMesh) {
  LlamaConfig c = moeConfig();
  c.moe.aux_loss_coef = 0.02;
  auto onUsersMesh = [](Llama& model, const DeviceMesh& mesh) {
    int64_t dtensors = 0, params = 0;
    for (const auto& item : model->named_parameters()) {
      ++params;
      if (!is_dtensor(item.value())) continue;
      ++dtensors;
      const DeviceMesh& on = dtensor_spec(item.value()).mesh;
      EXPECT_EQ(on.get_root_mesh().id(), mesh.id()) << item.key() << " is on " << on.str() << ", of another mesh than "
                                                    << mesh.str();
    }
    EXPECT_EQ(dtensors, params) << "under FSDP every parameter is a DTensor";
    // The dense parameters' data-parallel dimension is registered on the
    // user's mesh: every rank of a tp coordinate.
    EXPECT_EQ(mesh["dp_shard_cp"].size(), mesh.size() / (mesh.ndim() == 3 ? mesh.shape()[2] : 1));
    EXPECT_EQ(mesh["dp_shard_cp"].get_group(), data_parallel_group(mesh));
  };
  struct Layout {
    const char* what;
    std::vector<int64_t> shape;
    Names names;
    ParallelDims dims;
  };
  for (const Layout& l : {Layout{"(dp, ep, tp) = (1, 2, 2)", {1, 2, 2}, {"dp", "ep", "tp"},
                                 ParallelDims().ep(2).tp(2).world_size(4)},
                          Layout{"(dp, ep) = (2, 2)", {2, 2}, {"dp", "ep"}, ParallelDims().ep(2).world_size(4)}}) {
    SCOPED_TRACE(l.what);
    const TrainRun want =
        trainOn(4, c, [&] { return init_device_mesh("cpu", l.shape, l.names); }, DataParallel::FSDP, onUsersMesh);
    const TrainRun got = trainOn(4, c, [&] { return l.dims.build_mesh("cpu"); }, DataParallel::FSDP, onUsersMesh);
    EXPECT_EQ(want.counts[static_cast<size_t>(CollectiveType::AllToAll)], 3 * 4 * c.n_layers)
        << "per step and MoE layer: dispatch and combine, forward and backward";
    expectSameRun(got, want);
  }
}

}  // namespace

// pipeline_llama on a ParallelDims mesh cuts over "pp" and parallelizes each
// stage over the rest as on the hand-built mesh: (pp, dp) as (pp, dp_shard),
// and with experts (pp, dp, ep) as (pp, dp_shard_mod_ep, dp_shard_in_ep),
// whose stages' parameters also live on the user's mesh.
TEST(ParallelDimsTest, PipelineOnAParallelDimsMeshTrainsLikeTheHandBuiltMesh) {
  const LlamaConfig moe = moeConfig();
  struct Layout {
    const char* what;
    LlamaConfig c;
    std::vector<int64_t> shape;
    Names names;
    ParallelDims dims;
  };
  // The whole model's weights (each rank's stage, merged) and rank 0's collectives.
  auto trainPipeline = [](const Layout& l, const std::function<DeviceMesh()>& make_mesh) {
    TrainRun out;
    std::mutex mu;
    std::map<std::string, at::Tensor> weights;
    run_ranks(4, [&](int rank) {
      const DeviceMesh mesh = make_mesh();
      Llama full(l.c);
      const LlamaPipeline pipe = pipeline_llama(full, mesh, {"1f1b", 2});
      std::set<const void*> mine;
      for (const auto& p : pipe.parameters()) {
        mine.insert(p.unsafeGetTensorImpl());
        if (is_dtensor(p)) {
          EXPECT_EQ(dtensor_spec(p).mesh.get_root_mesh().id(), mesh.id()) << dtensor_spec(p).mesh.str();
        }
      }
      Names rest = mesh.mesh_dim_names();
      rest.erase(rest.begin());  // "pp" first
      const ProcessGroup dp = data_parallel_group(mesh[rest]);
      torch::optim::AdamW opt(pipe.parameters(), torch::optim::AdamWOptions(1e-2));
      CommCounter comm;
      for (int step = 0; step < 3; ++step) {
        const at::Tensor b =
            batchOf(l.c.vocab_size, step).narrow(0, dp.rank() * (kB / dp.size()), kB / dp.size());
        opt.zero_grad();
        pipe.pipeline->step(b.narrow(1, 0, kS), b.narrow(1, 1, kS));
        opt.step();
      }
      std::array<int64_t, kNumCollectiveTypes> counts{};
      for (size_t i = 0; i < kNumCollectiveTypes; ++i) counts[i] = comm.count(static_cast<CollectiveType>(i));
      for (const auto& item : full->named_parameters()) {
        if (!mine.count(item.value().unsafeGetTensorImpl())) continue;
        const at::Tensor whole = is_dtensor(item.value()) ? full_tensor(item.value().detach()) : item.value().detach();
        std::lock_guard<std::mutex> lock(mu);
        weights[item.key()] = whole.clone();
      }
      std::lock_guard<std::mutex> lock(mu);
      if (rank == 0) out.counts = counts;
    });
    for (auto& [name, w] : weights) out.params.emplace_back(name, w);
    return out;
  };
  for (const Layout& l : {Layout{"(pp, dp) = (2, 2)", denseConfig(), {2, 2}, {"pp", "dp"},
                                 ParallelDims().pp(2).world_size(4)},
                          Layout{"(pp, dp, ep) = (2, 1, 2)", moe, {2, 1, 2}, {"pp", "dp", "ep"},
                                 ParallelDims().pp(2).ep(2).world_size(4)}}) {
    SCOPED_TRACE(l.what);
    const TrainRun want = trainPipeline(l, [&] { return init_device_mesh("cpu", l.shape, l.names); });
    const TrainRun got = trainPipeline(l, [&] { return l.dims.build_mesh("cpu"); });
    EXPECT_EQ(got.params.size(), static_cast<size_t>(Llama(l.c)->named_parameters().size())) << "every stage's";
    expectSameRun(got, want);
  }
}
