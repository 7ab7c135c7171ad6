// PyTorch's tensor-parallel API to the letter (#54): keyword layouts, every
// argument counted, several outputs, SequenceParallel's redistribution, the
// mesh and plan from context, the root as a plan key. Expectations ported
// from PyTorch's test_tp_style.py and test_parallelize_api.py: values against
// one device in float64 and the collectives of each pass.
#include "close.h"
#include "dist.h"
#include "parity.h"

#include "dtp/ac/activation_checkpoint.h"
#include "dtp/comm_counter.h"
#include "dtp/nn/modules.h"
#include "dtp/random.h"
#include "dtp/tp/loss_parallel.h"
#include "dtp/tp/parallelize.h"

#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/optim/sgd.h>

using namespace dtp;
using dtp::test::data;
using dtp::test::expect_error;
using dtp::test::run_ranks;

namespace {

constexpr double kTol = 1e-12;  // float64: TP and one device agree to rounding

at::Tensor chunk(const at::Tensor& t, int64_t dim, int w, int r) {
  return t.narrow(dim, chunk_start(t.size(dim), w, r), chunk_size(t.size(dim), w, r));
}

template <class M>
void setDeterministic(M& m, double seed = 0) {
  torch::NoGradGuard g;
  for (auto& p : m->parameters()) p.copy_(data(p.sizes().vec(), seed += 1).to(p.scalar_type()));
}

// --- SequenceParallel -------------------------------------------------------

// PyTorch's test_sequence_parallel_style: a DTensor input that is not
// Shard(sequence_dim) is redistributed. A Replicate input (KempnerForge's
// replicated embedding before an SP norm) becomes S(1) by a local chunk, and
// its gradient is all-gathered back; an S(0) input is exchanged all-to-all
// both ways. dtp adds one all-reduce of the weight's Partial gradient at the
// end of backward (PyTorch leaves it Partial for the optimizer).
TEST(TpApiTest, SequenceParallelRedistributesInputsNotOnTheSequenceDim) {
  for (int w : {2, 3}) {
    run_ranks(w, [&](int) {
      auto mesh = init_device_mesh("cpu", {w});
      const at::Tensor full = data({4, 2 * w + 1, 6});  // uneven sequence shards
      dtp::nn::RMSNorm ref(6);
      ref->to(at::kDouble);
      setDeterministic(ref);
      at::Tensor fx = full.clone().requires_grad_(true);
      at::Tensor ry = ref(fx);
      const at::Tensor g = data(ry.sizes().vec(), 5.0);
      (ry * g).sum().backward();
      for (const Placement in : {Placement(Replicate()), Placement(Shard(0))}) {
        SCOPED_TRACE(to_string(Placements{in}));
        dtp::nn::RMSNorm norm(6);
        norm->to(at::kDouble);
        setDeterministic(norm);
        parallelize_module(*norm, mesh, SequenceParallel());
        at::Tensor x = distribute_tensor(full, mesh, {in}).detach().requires_grad_(true);
        CommCounter fwd;
        at::Tensor y = norm(x);
        EXPECT_EQ(placements(y), Placements{Shard(1)});
        if (in.is_replicate()) {
          EXPECT_EQ(fwd.total_count(), 0) << fwd.str();
        } else {
          EXPECT_EQ(fwd.count(CollectiveType::AllToAll), 1) << fwd.str();
          EXPECT_EQ(fwd.total_count(), 1) << fwd.str();
        }
        EXPECT_CLOSE(full_tensor(y), ry, kTol, kTol);
        const at::Tensor dg = distribute_tensor(g, mesh, {Shard(1)});
        CommCounter bwd;
        (y * dg).sum().backward();
        EXPECT_EQ(bwd.count(in.is_replicate() ? CollectiveType::AllGather : CollectiveType::AllToAll), 1) << bwd.str();
        EXPECT_EQ(bwd.count(CollectiveType::AllReduce), 1) << bwd.str();  // the weight's gradient
        EXPECT_EQ(bwd.total_count(), 2) << bwd.str();
        EXPECT_EQ(placements(x.grad()), Placements{in});
        EXPECT_CLOSE(full_tensor(x.grad()), fx.grad(), kTol, kTol);
        EXPECT_CLOSE(full_tensor(norm->weight.grad()), ref->weight.grad(), kTol, kTol);
      }
    });
  }
}

// SequenceParallel(sequence_dim=0, use_local_output=true): a plain input is
// this rank's rows and the output comes back plain.
TEST(TpApiTest, SequenceParallelSequenceDimZeroAndLocalOutput) {
  run_ranks(3, [&](int rank) {
    auto mesh = init_device_mesh("cpu", {3});
    dtp::nn::LayerNorm norm(torch::nn::LayerNormOptions({5})), ref(torch::nn::LayerNormOptions({5}));
    norm->to(at::kDouble);
    ref->to(at::kDouble);
    setDeterministic(norm);
    setDeterministic(ref);
    parallelize_module(*norm, mesh, SequenceParallel(SequenceParallelOptions().sequence_dim(0).use_local_output(true)));
    const at::Tensor full = data({7, 2, 5});  // 3, 3, 1 rows
    CommCounter fwd;
    at::Tensor y = norm(chunk(full, 0, 3, rank));
    EXPECT_FALSE(is_dtensor(y));
    EXPECT_EQ(fwd.total_count(), 0) << fwd.str();
    EXPECT_CLOSE(y, chunk(ref(full), 0, 3, rank), kTol, kTol);
  });
}

// Dropout under SequenceParallel draws the mask one device draws for the
// same seed (dtp's RNG; PyTorch's differs by placement).
TEST(TpApiTest, SequenceParallelDropoutEqualsOneDevice) {
  // The reference draws from ATen's global generator: once, before the
  // ranks (threads here) start, which would otherwise draw from it at once.
  const at::Tensor full = data({3, 9, 4}) + 2.0;
  at::manual_seed(7);
  const at::Tensor ref = at::dropout(full, 0.5, /*train=*/true);
  run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2});
    dtp::nn::Dropout drop(0.5);
    parallelize_module(*drop, mesh, SequenceParallel());
    manual_seed(7);
    at::Tensor y = drop(distribute_tensor(full, mesh, {Shard(1)}));
    EXPECT_EQ(placements(y), Placements{Shard(1)});
    EXPECT_CLOSE(full_tensor(y), ref, 0.0, 0.0);
  });
}

// --- PrepareModuleInput: every argument, by position and by name ----------

struct KwargImpl : torch::nn::Module {
  DTP_FORWARD_ARGS("x", "y", "z");
  dtp::nn::Linear linear{register_module("linear", dtp::nn::Linear(8, 8))};
  at::Tensor forward(const at::Tensor& x, const at::Tensor& y, double z = 2.0) { return linear(x) + y + z; }
};
DTP_MODULE(Kwarg);

// PyTorch's test_prepare_module_kwargs_input: `y` given by name, S(0) ->
// R: one all-gather; then `x` too: two.
TEST(TpApiTest, KwargLayoutsKeyByTheForwardsArgumentNames) {
  run_ranks(2, [&](int rank) {
    auto mesh = init_device_mesh("cpu", {2});
    const at::Tensor x = data({2, 8}, 1.0), y_full = data({2, 8}, 2.0);
    for (bool x_too : {false, true}) {
      SCOPED_TRACE(x_too ? "x and y by name" : "y by name");
      Kwarg m, ref;
      m->to(at::kDouble);
      ref->to(at::kDouble);
      setDeterministic(m);
      setDeterministic(ref);
      parallelize_module(*m->linear, mesh, ColwiseParallel(ColwiseParallelOptions().use_local_output(false)));
      KwargLayouts in{{"y", Shard(0)}}, desired{{"y", Replicate()}};
      if (x_too) {
        in["x"] = Shard(0);
        desired["x"] = Replicate();
      }
      parallelize_module(*m, mesh,
                         PrepareModuleInput(PrepareModuleInputOptions().input_kwarg_layouts(in).desired_input_kwarg_layouts(desired)));
      CommCounter fwd;
      at::Tensor out = m(x_too ? chunk(x, 0, 2, rank) : x, chunk(y_full, 0, 2, rank), 3.0);
      EXPECT_EQ(fwd.count(CollectiveType::AllGather), x_too ? 2 : 1) << fwd.str();
      EXPECT_EQ(fwd.total_count(), x_too ? 2 : 1) << fwd.str();
      EXPECT_EQ(out.sizes(), (std::vector<int64_t>{2, 8}));
      EXPECT_CLOSE(full_tensor(out), ref(x, y_full, 3.0), kTol, kTol);
      // A DTensor passed for x (PyTorch's last case) is redistributed alike.
      if (x_too) {
        const at::Tensor x_dt = distribute_tensor(x, mesh, {Shard(0)});
        CommCounter again;
        at::Tensor out2 = m(x_dt, chunk(y_full, 0, 2, rank));
        EXPECT_EQ(again.count(CollectiveType::AllGather), 2) << again.str();
        EXPECT_CLOSE(full_tensor(out2), ref(x, y_full), kTol, kTol);
      }
    }
  });
}

TEST(TpApiTest, KwargLayoutErrorsNameTheArgumentsAndTheFix) {
  run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2});
    Kwarg m;
    expect_error([&] {
      parallelize_module(*m, mesh, PrepareModuleInput(PrepareModuleInputOptions()
                                                          .input_kwarg_layouts({{"mask", Shard(0)}})
                                                          .desired_input_kwarg_layouts({{"mask", Replicate()}})));
    }, {"PrepareModuleInput at ''", "'mask', which is not an argument", "its arguments are x, y, z"});
    expect_error([&] {
      parallelize_module(*m, mesh, PrepareModuleInput(PrepareModuleInputOptions()
                                                          .input_layouts({std::nullopt, Shard(0)})
                                                          .desired_input_layouts({std::nullopt, Replicate()})
                                                          .input_kwarg_layouts({{"y", Shard(0)}})
                                                          .desired_input_kwarg_layouts({{"y", Replicate()}})));
    }, {"argument 1 ('y')", "in both input_layouts and input_kwarg_layouts"});
    expect_error([&] {
      parallelize_module(*m, mesh, PrepareModuleInput(PrepareModuleInputOptions()
                                                          .input_kwarg_layouts({{"y", Shard(0)}})
                                                          .desired_input_kwarg_layouts({{"x", Replicate()}})));
    }, {"input_kwarg_layouts has 'y' but desired_input_kwarg_layouts does not"});
    dtp::nn::Linear plain(4, 4);  // names no arguments
    expect_error([&] {
      parallelize_module(*plain, mesh, PrepareModuleInput(PrepareModuleInputOptions()
                                                              .input_kwarg_layouts({{"input", Shard(0)}})
                                                              .desired_input_kwarg_layouts({{"input", Replicate()}})));
    }, {"does not name its forward's arguments", "DTP_FORWARD_ARGS"});
  });
}

struct MixedImpl : torch::nn::Module {
  dtp::nn::Linear linear{register_module("linear", dtp::nn::Linear(8, 8))};
  // Non-tensor and optional arguments between the tensors.
  at::Tensor forward(const at::Tensor& x, int64_t scale, std::optional<at::Tensor> bias) {
    at::Tensor h = linear(x) * static_cast<double>(scale);
    return bias ? h + *bias : h;
  }
};
DTP_MODULE(Mixed);

// NOTE: [Argument positions]: entries count every argument, as PyTorch
// counts positional arguments; a non-tensor takes nullopt; an absent
// optional is skipped.
TEST(TpApiTest, PrepareModuleInputCountsEveryArgument) {
  run_ranks(2, [&](int rank) {
    auto mesh = init_device_mesh("cpu", {2});
    Mixed m, ref;
    m->to(at::kDouble);
    ref->to(at::kDouble);
    setDeterministic(m);
    setDeterministic(ref);
    parallelize_module(*m, mesh, {{"linear", ColwiseParallel(ColwiseParallelOptions().use_local_output(false))},
                                  {"", PrepareModuleInput(PrepareModuleInputOptions()
                                                              .input_layouts({Shard(0), std::nullopt, Shard(0)})
                                                              .desired_input_layouts({Replicate(), std::nullopt, Replicate()}))}});
    const at::Tensor x = data({4, 8}, 1.0), b = data({4, 8}, 2.0);
    CommCounter both;
    at::Tensor out = m(chunk(x, 0, 2, rank), 3, chunk(b, 0, 2, rank));
    EXPECT_EQ(both.count(CollectiveType::AllGather), 2) << both.str();
    EXPECT_CLOSE(full_tensor(out), ref(x, 3, b), kTol, kTol);
    CommCounter absent;
    out = m(chunk(x, 0, 2, rank), 3, std::nullopt);
    EXPECT_EQ(absent.count(CollectiveType::AllGather), 1) << absent.str();
    EXPECT_CLOSE(full_tensor(out), ref(x, 3, std::nullopt), kTol, kTol);

    // A layout for the int, too few entries, and mismatched lists.
    Mixed bad;
    parallelize_module(*bad, mesh, PrepareModuleInput(PrepareModuleInputOptions()
                                                          .input_layouts({Shard(0), Shard(0), std::nullopt})
                                                          .desired_input_layouts({Replicate(), Replicate(), std::nullopt})));
    expect_error([&] { bad(x, 3, std::nullopt); }, {"argument 1 is not a tensor", "Give nullopt for it"});
    Mixed short_plan;
    parallelize_module(*short_plan, mesh,
                       PrepareModuleInput(PrepareModuleInputOptions().input_layouts(Shard(0)).desired_input_layouts(Replicate())));
    expect_error([&] { short_plan(x, 3, std::nullopt); },
                 {"forward got 3 arguments, but input_layouts has 1 entries", "one entry per argument"});
    expect_error([&] {
      parallelize_module(*short_plan, mesh, PrepareModuleInput(PrepareModuleInputOptions()
                                                                   .input_layouts(Shard(0))
                                                                   .desired_input_layouts({Replicate(), std::nullopt})));
    }, {"got 1 input_layouts but 2 desired_input_layouts"});
  });
}

// PyTorch's defaults: use_local_output=false gives DTensors to forward.
TEST(TpApiTest, PrepareModuleInputUseLocalOutputDefaultsToDTensors) {
  run_ranks(2, [&](int rank) {
    auto mesh = init_device_mesh("cpu", {2});
    for (bool local : {false, true}) {
      Mixed m;
      m->to(at::kDouble);
      bool seen_dtensor = false;
      parallelize_module(*m, mesh, PrepareModuleInput(PrepareModuleInputOptions()
                                                          .input_layouts({Shard(0), std::nullopt, std::nullopt})
                                                          .desired_input_layouts({Replicate(), std::nullopt, std::nullopt})
                                                          .use_local_output(local)));
      m->pre_hooks.push_back([&](dtp::nn::Slots& in) { seen_dtensor = is_dtensor(in[0]); });
      ImplicitReplicationGuard implicit;  // the plain weights meet a Replicate input
      m(chunk(data({4, 8}), 0, 2, rank), 1, std::nullopt);
      EXPECT_EQ(seen_dtensor, !local);
    }
  });
}

// --- Several outputs --------------------------------------------------------

struct TwoOutImpl : torch::nn::Module {
  DTP_FORWARD_ARGS("x");
  dtp::nn::Linear proj{register_module("proj", dtp::nn::Linear(6, 6))};
  // Attention's (out, weights), or an MoE block's (h, aux_loss).
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x) {
    at::Tensor h = proj(x);
    return {h, (h * h).mean()};
  }
};
DTP_MODULE(TwoOut);

struct ListOutImpl : torch::nn::Module {
  std::vector<at::Tensor> forward(const at::Tensor& x) { return {x * 2, x + 1, x.sum()}; }
};
DTP_MODULE(ListOut);

TEST(TpApiTest, PrepareModuleOutputTakesOneLayoutPerOutput) {
  run_ranks(2, [&](int rank) {
    auto mesh = init_device_mesh("cpu", {2});
    TwoOut m, ref;
    m->to(at::kDouble);
    ref->to(at::kDouble);
    setDeterministic(m);
    setDeterministic(ref);
    // The output R -> S(0); the loss left alone (nullopt).
    parallelize_module(*m, mesh, PrepareModuleOutput(PrepareModuleOutputOptions()
                                                         .output_layouts({Replicate(), std::nullopt})
                                                         .desired_output_layouts({Shard(0), std::nullopt})));
    const at::Tensor x = data({5, 6});
    CommCounter comm;
    auto [h, aux] = m(x);
    EXPECT_EQ(comm.total_count(), 0) << comm.str();  // R -> S(0) is a local chunk
    EXPECT_FALSE(is_dtensor(h));                     // use_local_output defaults to true
    auto [rh, raux] = ref(x);
    EXPECT_CLOSE(h, chunk(rh, 0, 2, rank), kTol, kTol);
    EXPECT_CLOSE(aux, raux, kTol, kTol);

    ListOut list;
    parallelize_module(*list, mesh, PrepareModuleOutput(PrepareModuleOutputOptions()
                                                            .output_layouts({std::nullopt, Replicate(), std::nullopt})
                                                            .desired_output_layouts({std::nullopt, Shard(1), std::nullopt})
                                                            .use_local_output(false)));
    std::vector<at::Tensor> outs = list(x);
    ASSERT_EQ(outs.size(), 3u);
    EXPECT_FALSE(is_dtensor(outs[0]));
    EXPECT_EQ(placements(outs[1]), Placements{Shard(1)});
    EXPECT_CLOSE(full_tensor(outs[1]), x + 1, kTol, kTol);

    TwoOut wrong;
    wrong->to(at::kDouble);
    parallelize_module(*wrong, mesh, PrepareModuleOutput(PrepareModuleOutputOptions()
                                                             .output_layouts(Replicate())
                                                             .desired_output_layouts(Shard(0))));
    expect_error([&] { wrong(x); }, {"forward returned 2 outputs, but output_layouts has 1 entries"});
  });
}

// output_layouts and desired_output_layouts have no default in PyTorch.
TEST(TpApiTest, PrepareModuleOutputRequiresBothLayouts) {
  run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2});
    TwoOut m;
    expect_error([&] { parallelize_module(*m, mesh, PrepareModuleOutput(PrepareModuleOutputOptions().output_layouts(Replicate()))); },
                 {"PrepareModuleOutput at ''", "output_layouts and desired_output_layouts are required"});
    expect_error([&] { parallelize_module(*m, mesh, PrepareModuleOutput()); }, {"are required"});
  });
}

// PyTorch's PrepareModuleInputOutput keywords in one options struct, and a
// checkpoint_wrapper around a module with two outputs and an optional
// argument: the same values and gradients as without it.
TEST(TpApiTest, PrepareModuleInputOutputAndCheckpointWithSeveralOutputs) {
  run_ranks(2, [&](int rank) {
    auto mesh = init_device_mesh("cpu", {2});
    for (bool ckpt : {false, true}) {
      SCOPED_TRACE(ckpt ? "checkpointed" : "plain");
      TwoOut m, ref;
      m->to(at::kDouble);
      ref->to(at::kDouble);
      setDeterministic(m);
      setDeterministic(ref);
      parallelize_module(*m, mesh, {{"proj", ColwiseParallel(ColwiseParallelOptions().use_local_output(false))},
                                    {"", PrepareModuleInputOutput(PrepareModuleInputOutputOptions()
                                                                      .input_kwarg_layouts({{"x", Shard(0)}})
                                                                      .desired_input_kwarg_layouts({{"x", Replicate()}})
                                                                      .output_layouts({Shard(1), Replicate()})
                                                                      .desired_output_layouts({Replicate(), Replicate()}))}});
      if (ckpt) checkpoint_wrapper(*m);
      const at::Tensor x = data({4, 6});
      at::Tensor lx = chunk(x, 0, 2, rank).clone().requires_grad_(true);
      auto [h, aux] = m(lx);
      at::Tensor fx = x.clone().requires_grad_(true);
      auto [rh, raux] = ref(fx);
      EXPECT_CLOSE(h, rh, kTol, kTol);
      EXPECT_CLOSE(aux, raux, kTol, kTol);
      (h.sum() + aux * 3).backward();
      (rh.sum() + raux * 3).backward();
      EXPECT_CLOSE(lx.grad(), chunk(fx.grad(), 0, 2, rank), kTol, kTol);
      EXPECT_CLOSE(full_tensor(m->proj->weight.grad()), ref->proj->weight.grad(), kTol, kTol);
    }
  });
}

// --- parallelize_module -----------------------------------------------------

struct LayersImpl : torch::nn::Module {
  torch::nn::ModuleList layers{register_module("layers", torch::nn::ModuleList())};
  LayersImpl() {
    for (int i = 0; i < 12; ++i) layers->push_back(dtp::nn::Linear(4, 4));
  }
};
TORCH_MODULE(Layers);

// "layers.1*" matches layers.1, layers.10 and layers.11 (a partial-atom
// wildcard, as fnmatch in PyTorch), and "" is the module itself.
TEST(TpApiTest, PartialWildcardAndTheRootAsAPlanKey) {
  run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2});
    Layers m;
    parallelize_module(*m, mesh, {{"layers.1*", ColwiseParallel()}});
    for (int i = 0; i < 12; ++i)
      EXPECT_EQ(is_dtensor(m->layers[i]->as<torch::nn::LinearImpl>()->weight), i == 1 || i == 10 || i == 11) << i;
    dtp::nn::Linear lin(4, 4);
    parallelize_module(*lin, mesh, {{"", RowwiseParallel()}});
    EXPECT_EQ(placements(lin->weight), Placements{Shard(1)});
  });
}

// The mesh from DeviceMeshGuard for both overloads; no plan: a warning and
// no change, as PyTorch's.
TEST(TpApiTest, MeshAndPlanFromContext) {
  run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2});
    dtp::nn::Linear a(4, 4), b(4, 4), c(4, 4);
    expect_error([&] { parallelize_module(*a, ColwiseParallel()); }, {"no mesh given", "DeviceMeshGuard"});
    {
      DeviceMeshGuard guard(mesh);
      parallelize_module(*a, ColwiseParallel());
      parallelize_module(*b, {{"", RowwiseParallel()}});
      parallelize_module(*c);
    }
    EXPECT_EQ(placements(a->weight), Placements{Shard(0)});
    EXPECT_EQ(placements(b->weight), Placements{Shard(1)});
    EXPECT_FALSE(is_dtensor(c->weight));
    parallelize_module(*c, mesh);
    EXPECT_FALSE(is_dtensor(c->weight));
    expect_error([&] { parallelize_module(*c, init_device_mesh("cpu", {1, 2})); }, {"needs a 1-D mesh"});
  });
}

// src_data_rank = nullopt: each rank keeps its own data (no broadcast or
// scatter), and the only collective is the 8-byte rule-agreement check.
TEST(TpApiTest, SrcDataRankNulloptKeepsEachRanksData) {
  run_ranks(2, [&](int rank) {
    auto mesh = init_device_mesh("cpu", {2});
    for (std::optional<int> src : {std::optional<int>(), std::optional<int>(0)}) {
      SCOPED_TRACE(src ? "src_data_rank=0" : "src_data_rank=nullopt");
      dtp::nn::Linear m(4, 6);
      m->to(at::kDouble);
      setDeterministic(m, 10.0 * rank);  // different weights on each rank
      const at::Tensor mine = m->weight.detach().clone(), rank0 = data({6, 4}, 1.0);
      CommCounter comm;
      parallelize_module(*m, mesh, {{"", ColwiseParallel()}}, src);
      EXPECT_EQ(comm.count(CollectiveType::AllGather), 1) << comm.str();
      EXPECT_EQ(comm.bytes(CollectiveType::AllGather), 16) << comm.str();
      EXPECT_EQ(comm.total_count(), src ? 3 : 1) << comm.str();  // + the weight's and the bias's scatter
      EXPECT_CLOSE(to_local(m->weight), chunk(src ? rank0 : mine, 0, 2, rank), 0.0, 0.0);
    }
  });
}

// ColwiseParallel(output_layouts=Replicate()): the output is gathered.
TEST(TpApiTest, ColwiseOutputReplicate) {
  run_ranks(3, [&](int) {
    auto mesh = init_device_mesh("cpu", {3});
    dtp::nn::Linear m(4, 7), ref(4, 7);
    m->to(at::kDouble);
    ref->to(at::kDouble);
    setDeterministic(m);
    setDeterministic(ref);
    parallelize_module(*m, mesh, ColwiseParallel(ColwiseParallelOptions().output_layouts(Replicate())));
    const at::Tensor x = data({5, 4});
    CommCounter fwd;
    at::Tensor y = m(x);
    EXPECT_EQ(fwd.count(CollectiveType::AllGather), 1) << fwd.str();
    EXPECT_EQ(fwd.total_count(), 1) << fwd.str();
    EXPECT_FALSE(is_dtensor(y));
    EXPECT_CLOSE(y, ref(x), kTol, kTol);
  });
}

// --- loss_parallel ----------------------------------------------------------

TEST(TpApiTest, LossParallelChecksTheClassDimAndTheTarget) {
  run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2});
    const at::Tensor logits = data({4, 10});
    const at::Tensor target = at::tensor({1, 7, 3, 9}, at::kLong);
    // Sharded on the batch dim only: PyTorch raises, so does dtp.
    expect_error([&] {
      LossParallelGuard guard;
      torch::nn::functional::cross_entropy(distribute_tensor(logits, mesh, {Shard(0)}), target);
    }, {"loss_parallel: expected logits sharded on the class dim 1", "S(0)"});
    // Class probabilities as the target: PyTorch documents them unsupported;
    // dtp's rules compute them (the class sum of log-probabilities times the
    // target is one more Partial sum): one device's value and gradient.
    {
      const at::Tensor probs = at::softmax(data({4, 10}, 3.0), 1);
      at::Tensor x = distribute_tensor(logits, mesh, {Shard(1)}).detach().requires_grad_(true);
      at::Tensor loss;
      {
        LossParallelGuard guard;
        loss = torch::nn::functional::cross_entropy(x, probs);
        loss.backward();
      }
      at::Tensor fx = logits.clone().requires_grad_(true);
      at::Tensor rloss = torch::nn::functional::cross_entropy(fx, probs);
      rloss.backward();
      EXPECT_CLOSE(full_tensor(loss), rloss, kTol, kTol);
      EXPECT_CLOSE(full_tensor(x.grad()), fx.grad(), kTol, kTol);
    }
    // 3-D logits [N, C, d] (the class dim 1): values and gradients of one device.
    const at::Tensor full = data({3, 10, 5});
    const at::Tensor t3 = at::remainder(at::arange(15, at::kLong) * 7, 10).view({3, 5});
    at::Tensor x = distribute_tensor(full, mesh, {Shard(1)}).detach().requires_grad_(true);
    at::Tensor loss;
    {
      LossParallelGuard guard;
      loss = torch::nn::functional::cross_entropy(x, t3);
      loss.backward();
    }
    at::Tensor fx = full.clone().requires_grad_(true);
    at::Tensor rloss = torch::nn::functional::cross_entropy(fx, t3);
    rloss.backward();
    EXPECT_CLOSE(full_tensor(loss), rloss, kTol, kTol);
    EXPECT_CLOSE(full_tensor(x.grad()), fx.grad(), kTol, kTol);
  });
}

// --- KempnerForge's layout: a replicated embedding before SP norms ---------

struct KfModelImpl : torch::nn::Module {
  dtp::nn::Embedding emb{register_module("emb", dtp::nn::Embedding(16, 8))};
  dtp::nn::RMSNorm norm1{register_module("norm1", dtp::nn::RMSNorm(8))};
  struct MlpImpl : torch::nn::Module {
    dtp::nn::Linear w1{register_module("w1", dtp::nn::Linear(8, 12))};
    dtp::nn::Linear w2{register_module("w2", dtp::nn::Linear(12, 8))};
    at::Tensor forward(const at::Tensor& x) { return w2(at::gelu(w1(x))); }
  };
  dtp::nn::Hooked<MlpImpl> mlp{register_module("mlp", dtp::nn::Hooked<MlpImpl>())};
  dtp::nn::RMSNorm norm2{register_module("norm2", dtp::nn::RMSNorm(8))};
  dtp::nn::Linear head{register_module("head", dtp::nn::Linear(torch::nn::LinearOptions(8, 16).bias(false)))};
  at::Tensor forward(const at::Tensor& tokens) {
    at::Tensor h = norm1(emb(tokens));
    h = h + mlp(h);
    return head(norm2(h));
  }
};
TORCH_MODULE(KfModel);

// The plan keeps the embedding's output Replicate; each SP norm then
// redistributes R -> S(1) itself (PyTorch's SequenceParallel semantics; dtp
// used to pass it through unsharded). Per step, with PyTorch's
// redistributions: forward all_reduce 1 (embedding) + 3 (loss_parallel),
// all_gather 2 (the MLP's and the head's inputs), reduce_scatter 1 (w2);
// backward reduce_scatter 2 and all_gather 2 (their reverses; norm1's R ->
// S(1) input is a local chunk whose gradient is all-gathered, the MLP's
// gather's gradient is reduce-scattered), and dtp's one all_reduce of the
// replicated parameters' Partial gradients at the end of backward (norm
// weights, w2's bias), which PyTorch leaves Partial for the optimizer.
TEST(TpApiTest, ReplicatedEmbeddingBeforeSequenceParallelNormsTrainsLikeOneDevice) {
  run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2});
    KfModel m, ref;
    m->to(at::kDouble);
    ref->to(at::kDouble);
    setDeterministic(m);
    setDeterministic(ref);
    parallelize_module(*m, mesh, {
        {"emb", RowwiseParallel(RowwiseParallelOptions().input_layouts(Replicate()).output_layouts(Replicate())
                                    .use_local_output(false))},
        {"norm1", SequenceParallel()},
        {"mlp", PrepareModuleInput(PrepareModuleInputOptions().input_layouts(Shard(1)).desired_input_layouts(Replicate()))},
        {"mlp.w1", ColwiseParallel()},
        {"mlp.w2", RowwiseParallel(RowwiseParallelOptions().output_layouts(Shard(1)).use_local_output(false))},
        {"norm2", SequenceParallel()},
        {"head", ColwiseParallel(ColwiseParallelOptions().input_layouts(Shard(1)).use_local_output(false))},
    });
    torch::optim::SGD opt(m->parameters(), torch::optim::SGDOptions(0.1));
    torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1));
    const at::Tensor tokens = at::remainder(at::arange(2 * 6, at::kLong) * 5, 16).view({2, 6});
    const at::Tensor labels = at::remainder(tokens * 3 + 1, 16);
    for (int step = 0; step < 3; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      CommCounter fwd;
      at::Tensor loss;
      {
        LossParallelGuard lp;
        loss = torch::nn::functional::cross_entropy(m(tokens).flatten(0, 1), labels.flatten());
      }
      EXPECT_EQ(fwd.count(CollectiveType::AllReduce), 4) << fwd.str();
      EXPECT_EQ(fwd.count(CollectiveType::AllGather), 2) << fwd.str();
      EXPECT_EQ(fwd.count(CollectiveType::ReduceScatter), 1) << fwd.str();
      EXPECT_EQ(fwd.total_count(), 7) << fwd.str();
      opt.zero_grad();
      CommCounter bwd;
      loss.backward();
      EXPECT_EQ(bwd.count(CollectiveType::ReduceScatter), 2) << bwd.str();
      EXPECT_EQ(bwd.count(CollectiveType::AllGather), 2) << bwd.str();
      EXPECT_EQ(bwd.count(CollectiveType::AllReduce), 1) << bwd.str();
      EXPECT_EQ(bwd.total_count(), 5) << bwd.str();
      opt.step();
      ref_opt.zero_grad();
      at::Tensor ref_loss = torch::nn::functional::cross_entropy(ref(tokens).flatten(0, 1), labels.flatten());
      ref_loss.backward();
      ref_opt.step();
      EXPECT_CLOSE(full_tensor(loss), ref_loss, kTol, kTol);
    }
    for (const auto& p : ref->named_parameters())
      EXPECT_CLOSE(full_tensor(m->named_parameters()[p.key()]), p.value(), 1e-11, 1e-11) << p.key();
  });
}

}  // namespace
