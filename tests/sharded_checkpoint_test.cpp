// Sharded checkpoints (dtp::checkpoint): saved at one layout, loaded at
// another, every value equal bit for bit; each byte written once; errors that
// name the tensor or file and change nothing; a failed save leaves the
// previous checkpoint; an async save overlaps training and equals a sync one.
#include "dist.h"
#include "files.h"
#include "llama_util.h"

#include "dtp/dcp/checkpoint.h"
#include "dtp/dtensor.h"
#include "dtp/models/llama.h"
#include "dtp/models/parallelize.h"
#include "dtp/nn/modules.h"
#include "dtp/optim/adamw.h"
#include "dtp/tp/parallelize.h"

#include <sys/resource.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <csignal>
#include <filesystem>
#include <map>
#include <mutex>

using namespace dtp;
using namespace dtp::models;
using dtp::test::expect_error;
using dtp::test::kSeq;
using dtp::test::run_ranks;
using dtp::test::train_llama;

namespace {

namespace fs = std::filesystem;
using Values = std::map<std::string, at::Tensor>;

at::Tensor full(const at::Tensor& t) { return is_dtensor(t) ? full_tensor(t.detach()) : t.detach().clone(); }

// Every tensor of a state dict as a full plain tensor (a collective).
Values fullValues(const dcp::StateDict& sd) {
  Values v;
  for (const auto& [name, t] : sd.tensors) v[name] = full(t);
  return v;
}

Values fullState(torch::nn::Module& model, torch::optim::Optimizer* opt,
                 const dcp::StateDictOptions& options = llama_state_dict_options()) {
  Values v = fullValues(dcp::get_model_state_dict(model, options));
  if (opt) {
    for (auto& [k, t] : fullValues(dcp::get_optimizer_state_dict(model, *opt))) v[k] = t;
  }
  return v;
}

void expectBitEqual(const Values& got, const Values& want, const std::string& where) {
  ASSERT_EQ(got.size(), want.size()) << where;
  for (const auto& [name, w] : want) {
    auto it = got.find(name);
    ASSERT_NE(it, got.end()) << where << ": " << name;
    EXPECT_EQ(it->second.scalar_type(), w.scalar_type()) << where << ": " << name;
    EXPECT_TRUE(it->second.equal(w)) << where << ": " << name << " differs";
  }
}

class ShardedCheckpointTest : public dtp::test::TempDirTest {};

LlamaConfig config(uint64_t seed) {
  LlamaConfig c = dtp::test::small_llama_config(4);  // kv heads divide tp = 4; vocab 67 uneven
  c.dtype = at::kDouble;
  c.seed = seed;
  return c;
}

struct Layout {
  int64_t dp, tp;
  const char* data_parallel;  // "fsdp", "ddp" or "" (TP alone)
};

// A Llama at `l` (on this thread's default group) with AdamW.
Llama buildLlama(const Layout& l, uint64_t seed) {
  Llama model(config(seed));
  auto mesh = init_device_mesh("cpu", {l.dp, l.tp}, {"dp", "tp"});
  apply_tensor_parallel(model, mesh, TensorParallelOptions{true, kSeq});
  if (std::string(l.data_parallel) == "fsdp") apply_fsdp(model, mesh);
  if (std::string(l.data_parallel) == "ddp") apply_ddp(model, mesh);
  return model;
}

std::unique_ptr<torch::optim::AdamW> adamw(Llama& model) {
  return std::make_unique<dtp::optim::AdamW>(model->unique_parameters(), torch::optim::AdamWOptions(1e-2));
}

// Saved at (dp, tp) = (2, 2) under FSDP after 2 AdamW steps; loaded at (1, 4),
// (4, 1) FSDP, (2, 2) DDP, a group of one and one device without a group:
// every parameter and AdamW state equal bit for bit, the step restored, and
// training goes on like the uninterrupted run.
TEST_F(ShardedCheckpointTest, LlamaSavedAt2x2LoadsBitExactAtEveryLayout) {
  const std::string dir = file("ck");
  Values saved;
  std::vector<double> continued;  // steps 2, 3 of the saving run
  run_ranks(4, [&](int rank) {
    Llama model = buildLlama({2, 2, "fsdp"}, 7);
    auto opt = adamw(model);
    train_llama(model, *opt, 0, 2);
    dcp::save_state(dir, *model, opt.get(), {{"step", "2"}}, llama_state_dict_options());
    Values v = fullState(*model, opt.get());
    auto losses = train_llama(model, *opt, 2, 4);
    if (rank == 0) saved = v, continued = losses;
  });
  ASSERT_FALSE(saved.empty());
  ASSERT_TRUE(fs::exists(dir + "/index.json"));
  EXPECT_FALSE(fs::exists(dir + ".incomplete"));

  auto check = [&](Llama& model, torch::optim::AdamW& opt, const std::string& where) {
    auto meta = dcp::load_state(dir, *model, &opt, llama_state_dict_options());
    EXPECT_EQ(meta.at("step"), "2") << where;
    expectBitEqual(fullState(*model, &opt), saved, where);
    auto losses = train_llama(model, opt, 2, 4);
    for (size_t i = 0; i < losses.size(); ++i) EXPECT_NEAR(losses[i], continued[i], 1e-12) << where << " step " << i + 2;
  };
  for (Layout l : {Layout{1, 4, ""}, Layout{4, 1, "fsdp"}, Layout{2, 2, "ddp"}, Layout{1, 1, ""}}) {
    const std::string where = "dp=" + std::to_string(l.dp) + " tp=" + std::to_string(l.tp) + " " + l.data_parallel;
    run_ranks(static_cast<int>(l.dp * l.tp), [&](int) {
      Llama model = buildLlama(l, 99);  // other weights: the load must replace them all
      auto opt = adamw(model);
      check(model, *opt, where);
    });
  }
  Llama one(config(99));
  auto opt = adamw(one);
  check(one, *opt, "one device");
}

// A user module under a user plan, with Adam (amsgrad) and SGD (momentum):
// saved Colwise/Rowwise on 2 ranks, loaded with the plan swapped on 4 ranks
// (row pieces read into column shards; 3 rows on 4 ranks: one shard empty)
// and on one device.
struct MlpImpl : torch::nn::Module {
  dtp::nn::Linear fc1{register_module("fc1", dtp::nn::Linear(5, 3))};
  dtp::nn::Linear fc2{register_module("fc2", dtp::nn::Linear(3, 6))};
  at::Tensor forward(const at::Tensor& x) { return fc2(at::relu(fc1(x))); }
};
DTP_MODULE(Mlp);

std::unique_ptr<torch::optim::Optimizer> optimizerFor(const std::string& kind, Mlp& m) {
  if (kind == "adam") return std::make_unique<torch::optim::Adam>(m->parameters(), torch::optim::AdamOptions(0.1).amsgrad(true));
  return std::make_unique<torch::optim::SGD>(m->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
}

void trainMlp(Mlp& m, torch::optim::Optimizer& opt, int steps) {
  for (int s = 0; s < steps; ++s) {
    at::Tensor x = at::arange(20, at::kDouble).view({4, 5}).sin() * (s + 1);
    opt.zero_grad();
    m(x).pow(2).sum().backward();
    opt.step();
  }
}

TEST_F(ShardedCheckpointTest, UserModuleWithAdamAndSgdLoadsUnderAnotherPlan) {
  for (const std::string kind : {"adam", "sgd"}) {
    SCOPED_TRACE(kind);
    const std::string dir = file("mlp_" + kind);
    Values saved;
    run_ranks(2, [&](int rank) {
      at::manual_seed(1);
      Mlp m;
      m->to(at::kDouble);
      parallelize_module(*m, init_device_mesh("cpu", {2}, {"tp"}),
                         {{"fc1", ColwiseParallel()}, {"fc2", RowwiseParallel()}});
      auto opt = optimizerFor(kind, m);
      trainMlp(m, *opt, 2);
      dcp::save_state(dir, *m, opt.get(), {{"epoch", "3"}});
      Values v = fullState(*m, opt.get(), {});
      if (rank == 0) saved = v;
    });
    EXPECT_EQ(saved.count("optimizer.state.fc1.weight." + std::string(kind == "adam" ? "max_exp_avg_sq" : "momentum_buffer")), 1u);
    run_ranks(4, [&](int) {
      at::manual_seed(2);
      Mlp m;
      m->to(at::kDouble);
      parallelize_module(*m, init_device_mesh("cpu", {4}, {"tp"}),
                         {{"fc1", RowwiseParallel()}, {"fc2", ColwiseParallel()}});
      auto opt = optimizerFor(kind, m);
      EXPECT_EQ(dcp::load_state(dir, *m, opt.get()).at("epoch"), "3");
      expectBitEqual(fullState(*m, opt.get(), {}), saved, "4 ranks, plan swapped");
    });
    at::manual_seed(3);
    Mlp m;
    m->to(at::kDouble);
    auto opt = optimizerFor(kind, m);
    opt->param_groups()[0].options().set_lr(5.0);
    dcp::load_state(dir, *m, opt.get());
    expectBitEqual(fullState(*m, opt.get(), {}), saved, "one device");
    EXPECT_EQ(opt->param_groups()[0].options().get_lr(), 0.1) << "param group options restored";
  }
}

// Replicated bytes are written once, by the lowest rank holding them: under
// DDP at (2, 2) parameters are tp DTensors replicated over dp outside their
// mesh; only dp coordinate 0 (ranks 0 and 1) writes, and the files hold each
// parameter once.
TEST_F(ShardedCheckpointTest, ReplicasAreWrittenOnceByTheLowestRank) {
  const std::string dir = file("ddp");
  int64_t paramBytes = 0;
  run_ranks(4, [&](int rank) {
    Llama model = buildLlama({2, 2, "ddp"}, 7);
    dcp::save_state(dir, *model, nullptr, {}, llama_state_dict_options());
    if (rank == 0) {
      for (auto& p : model->unique_parameters()) paramBytes += (is_dtensor(p) ? dtensor_spec(p).numel() : p.numel()) * 8;
    }
  });
  const auto index = dcp::read_index(dir);
  std::set<std::string> files;
  int64_t pieceBytes = 0;
  for (const auto& [name, t] : index.tensors) {
    for (const auto& p : t.pieces) {
      files.insert(p.file);
      pieceBytes += static_cast<int64_t>(p.end - p.begin);
    }
  }
  EXPECT_EQ(files, (std::set<std::string>{"rank-00000.safetensors", "rank-00001.safetensors"}));
  EXPECT_EQ(pieceBytes, paramBytes);
  EXPECT_FALSE(fs::exists(dir + "/rank-00002.safetensors"));
  // The sequence-parallel norms are Replicate on tp as well: rank 0 alone.
  for (const auto& p : index.tensors.at("model.norm.weight").pieces) EXPECT_EQ(p.file, "rank-00000.safetensors");
}

// Each wrong input is an error that names what is wrong and the fix, raised on
// every rank, before any tensor changes.
TEST_F(ShardedCheckpointTest, BadCheckpointsAreNamedErrorsThatChangeNothing) {
  const std::string dir = file("ck"), mlp = file("mlp");
  run_ranks(2, [&](int) {
    Llama model = buildLlama({1, 2, ""}, 7);
    dcp::save_state(dir, *model, nullptr, {}, llama_state_dict_options());
    Mlp m;
    dcp::save_state(mlp, *m, nullptr);
  });
  auto onTwoRanks = [&](const std::string& path, LlamaConfig c, const std::vector<std::string>& parts) {
    run_ranks(2, [&](int) {
      Llama model(c);
      apply_tensor_parallel(model, init_device_mesh("cpu", {1, 2}, {"dp", "tp"}), TensorParallelOptions{true, kSeq});
      const Values before = fullState(*model, nullptr);
      expect_error([&] { dcp::load_state(path, *model, nullptr, llama_state_dict_options()); }, parts);
      expectBitEqual(fullState(*model, nullptr), before, "after a failed load");
    });
  };
  // Another model: every name listed.
  onTwoRanks(mlp, config(1), {"does not match the state dict", "missing from the checkpoint: model.tok_embeddings.weight",
                              "in the checkpoint but not asked for: model.fc1.bias", "another model"});
  // Another size.
  LlamaConfig wide = config(1);
  wide.ffn_hidden = 48;
  onTwoRanks(dir, wide, {"other dtype or shape", "'model.layers.0.feed_forward.w1.weight': saved Double[40, 32], here Double[48, 32]"});
  // Another dtype.
  LlamaConfig f32 = config(1);
  f32.dtype = at::kFloat;
  onTwoRanks(dir, f32, {"other dtype or shape", "saved Double", "here Float"});
  // A flipped byte in a rank's data: the checksum names the file and the piece.
  fs::copy(dir, file("flipped"));
  {
    std::string bytes = dtp::test::read_bytes(file("flipped") + "/rank-00001.safetensors");
    bytes[bytes.size() - 3] ^= 0x10;
    dtp::test::write_bytes(file("flipped") + "/rank-00001.safetensors", bytes);
  }
  onTwoRanks(file("flipped"), config(1), {"rank-00001.safetensors", "fails its checksum", "model.output.weight", "previous checkpoint"});
  // A truncated rank file.
  fs::copy(dir, file("cut"));
  fs::resize_file(file("cut") + "/rank-00000.safetensors", fs::file_size(dir + "/rank-00000.safetensors") - 100);
  onTwoRanks(file("cut"), config(1), {"rank-00000.safetensors", "truncated"});
  // An unfinished save and an old single-file checkpoint.
  fs::create_directories(file("half.incomplete"));
  onTwoRanks(file("half"), config(1), {"not a complete checkpoint", "did not finish", "half.incomplete", "previous checkpoint"});
  dtp::test::write_bytes(file("old.safetensors"), "x");
  onTwoRanks(file("old.safetensors"), config(1), {"single-file checkpoint", "load_checkpoint", "save again to convert"});
  // What cannot be saved.
  run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2}, {"tp"});
    dcp::StateDict partial;
    partial.add("p", from_local(at::ones({2}), mesh, {Partial()}));
    expect_error([&] { dcp::save(partial, file("partial")); }, {"'p' is f32[2](P(sum))", "Redistribute it"});
    dcp::StateDict complex;
    complex.add("c", at::ones({2}, at::kComplexFloat));
    expect_error([&] { dcp::save(complex, file("complex")); }, {"'c' has dtype ComplexFloat", "Convert it"});
  });
  EXPECT_FALSE(fs::exists(file("partial")));
}

// A save that cannot write (a file size limit stands in for a full disk)
// fails on every rank naming the cause and removes what it staged; the
// previous checkpoint stays whole and loads, and the next save succeeds over
// it.
TEST_F(ShardedCheckpointTest, FailedSaveLeavesThePreviousCheckpoint) {
  const std::string dir = file("ck");
  Values v1;
  run_ranks(2, [&](int rank) {
    Llama model = buildLlama({1, 2, ""}, 7);
    dcp::save_state(dir, *model, nullptr, {{"step", "1"}}, llama_state_dict_options());
    Values v = fullState(*model, nullptr);
    if (rank == 0) v1 = v;
  });
  struct rlimit old {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  auto previous = std::signal(SIGXFSZ, SIG_IGN);
  struct rlimit tiny = old;
  tiny.rlim_cur = 4096;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &tiny), 0);
  run_ranks(2, [&](int) {
    Llama model = buildLlama({1, 2, ""}, 8);
    expect_error([&] { dcp::save_state(dir, *model, nullptr, {{"step", "2"}}, llama_state_dict_options()); },
                 {"save of '" + dir + "' failed", "rank 0:", "rank 1:", "File too large", "previous checkpoint is unchanged"});
  });
  ::setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, previous);
  EXPECT_FALSE(fs::exists(dir + ".incomplete")) << "a failed save left its staging folder";
  run_ranks(2, [&](int) {
    Llama model = buildLlama({1, 2, ""}, 9);
    EXPECT_EQ(dcp::load_state(dir, *model, nullptr, llama_state_dict_options()).at("step"), "1");
    expectBitEqual(fullState(*model, nullptr), v1, "previous checkpoint");
    dcp::save_state(dir, *model, nullptr, {{"step", "3"}}, llama_state_dict_options());
  });
  EXPECT_FALSE(fs::exists(dir + ".incomplete"));
  EXPECT_EQ(dcp::read_index(dir).metadata.at("step"), "3");
}

// An async save returns before the files are written; training steps run while
// it is in flight, and the result equals a synchronous save of the same
// moment. A failed background write is thrown by wait().
TEST_F(ShardedCheckpointTest, AsyncSaveOverlapsTrainingAndEqualsASyncSave) {
  std::vector<int> overlapped(2, 0);
  run_ranks(2, [&](int rank) {
    Llama model = buildLlama({1, 2, ""}, 7);
    auto opt = adamw(model);
    dcp::AsyncSaver saver;
    train_llama(model, *opt, 0, 1);
    dcp::StateDict sd = dcp::get_model_state_dict(*model, llama_state_dict_options());
    for (auto& e : dcp::get_optimizer_state_dict(*model, *opt).tensors) sd.tensors.push_back(e);
    // A large extra tensor keeps the background write busy for a while.
    sd.add("ballast", at::ones({32 << 20}, at::kFloat));
    dcp::save(sd, file("sync"));
    saver.save(sd, file("async"));
    // Training changes the live tensors while the snapshot is written. The
    // same steps on every rank (in_flight() is this rank's writer alone).
    for (int step = 1; step <= 20; ++step) {
      overlapped[rank] += saver.in_flight();
      train_llama(model, *opt, step, step + 1);
    }
    saver.wait();
    saver.save(sd, "/dev/null/not-a-folder");
    expect_error([&] { saver.wait(); }, {"save of '/dev/null/not-a-folder' failed", "Not a directory"});
  });
  EXPECT_GE(overlapped[0], 1) << "no training step ran while the async save was in flight";
  std::printf("training steps while the async save was in flight: rank 0 %d, rank 1 %d\n", overlapped[0], overlapped[1]);
  // Equal to the synchronous save: every piece's bytes (the CRCs) and place.
  const auto a = dcp::read_index(file("async")), s = dcp::read_index(file("sync"));
  ASSERT_EQ(a.tensors.size(), s.tensors.size());
  for (const auto& [name, t] : s.tensors) {
    ASSERT_EQ(a.tensors.at(name).pieces.size(), t.pieces.size()) << name;
    for (size_t i = 0; i < t.pieces.size(); ++i) {
      EXPECT_EQ(a.tensors.at(name).pieces[i].crc32, t.pieces[i].crc32) << name;
      EXPECT_EQ(a.tensors.at(name).pieces[i].offsets, t.pieces[i].offsets) << name;
    }
  }
}

}  // namespace
