// Llama checkpoints: a run saved after 2 AdamW steps at one TP degree resumes
// at another (TP=2 -> 1 and 1 -> 2, with and without SP) with the losses of an
// uninterrupted 4-step run, which takes the restored AdamW state; a truncated,
// other-sized or missing file is an error naming the path that changes
// nothing; a failed save leaves the previous file byte-for-byte.
#include "close.h"
#include "dist.h"
#include "files.h"
#include "llama_util.h"

#include "comm/compat.h"
#include "dtp/dtensor.h"
#include "dtp/io/safetensors.h"
#include "dtp/models/checkpoint.h"
#include "dtp/models/llama.h"
#include "dtp/models/parallelize.h"

#include "dtp/optim/adamw.h"
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>

using namespace dtp;
using namespace dtp::models;
using dtp::test::full_named_params;
using dtp::test::kSeq;
using dtp::test::run_ranks;
using dtp::test::small_llama_config;
using dtp::test::train_llama;

namespace {

namespace fs = std::filesystem;

constexpr int kSteps = 4, kSaveAfter = 2;
constexpr double kTol = 1e-5;

std::unique_ptr<torch::optim::AdamW> adamw(Llama& model) {
  return std::make_unique<dtp::optim::AdamW>(model->unique_parameters(), torch::optim::AdamWOptions(1e-2));
}

struct Reference {
  std::vector<double> losses;      // steps 0..3, uninterrupted
  std::vector<std::pair<std::string, at::Tensor>> params;  // after step 3
};

Reference reference() {
  Llama model(small_llama_config());
  auto opt = adamw(model);
  Reference r;
  r.losses = train_llama(model, *opt, 0, kSteps);
  r.params = full_named_params(model);
  return r;
}

// Steps kSaveAfter..kSteps-1 of a resumed run against the uninterrupted one.
void expectResumedLikeReference(const std::vector<double>& losses,
                                const std::vector<std::pair<std::string, at::Tensor>>& params, const Reference& want) {
  ASSERT_EQ(losses.size(), static_cast<size_t>(kSteps - kSaveAfter));
  for (size_t i = 0; i < losses.size(); ++i)
    EXPECT_NEAR(losses[i], want.losses[kSaveAfter + i], kTol) << "step " << kSaveAfter + i;
  ASSERT_EQ(params.size(), want.params.size());
  for (size_t i = 0; i < params.size(); ++i)
    EXPECT_CLOSE(params[i].second, want.params[i].second, kTol, kTol) << params[i].first;
}

// The restored AdamW state: one entry per parameter, at step kSaveAfter.
void expectStateAtSaveStep(Llama& model, torch::optim::AdamW& opt) {
  const auto params = model->unique_parameters();
  EXPECT_EQ(opt.state().size(), params.size());
  for (const auto& p : params) {
    auto it = opt.state().find(compat::optimizer_state_key(p));
    ASSERT_NE(it, opt.state().end());
    EXPECT_EQ(static_cast<torch::optim::AdamWParamState&>(*it->second).step(), kSaveAfter);
  }
}

// Parameters and AdamW moments, cloned, to show a failed load changed nothing.
struct Snapshot {
  std::vector<at::Tensor> params, moments;
  size_t state_entries = 0;
};

Snapshot snapshot(Llama& model, torch::optim::AdamW& opt) {
  Snapshot s;
  s.state_entries = opt.state().size();
  for (const auto& p : model->unique_parameters()) {
    s.params.push_back(p.detach().clone());
    auto it = opt.state().find(compat::optimizer_state_key(p));
    if (it == opt.state().end()) continue;
    auto& st = static_cast<torch::optim::AdamWParamState&>(*it->second);
    s.moments.push_back(st.exp_avg().clone());
    s.moments.push_back(st.exp_avg_sq().clone());
  }
  return s;
}

// Another init (seed 99) after one step of its own, so that a partial load
// would show in the parameters and the AdamW state.
struct Trained {
  Llama model;
  std::unique_ptr<torch::optim::AdamW> opt;
};

Trained otherInitOneStep() {
  LlamaConfig c = small_llama_config();
  c.seed = 99;
  Trained t{Llama(c), nullptr};
  t.opt = adamw(t.model);
  train_llama(t.model, *t.opt, 0, 1);
  return t;
}

void expectSame(const Snapshot& got, const Snapshot& want) {
  EXPECT_EQ(got.state_entries, want.state_entries);
  ASSERT_EQ(got.params.size(), want.params.size());
  for (size_t i = 0; i < got.params.size(); ++i) EXPECT_TRUE(got.params[i].equal(want.params[i])) << "parameter " << i;
  ASSERT_EQ(got.moments.size(), want.moments.size());
  for (size_t i = 0; i < got.moments.size(); ++i) EXPECT_TRUE(got.moments[i].equal(want.moments[i])) << "moment " << i;
}

class CheckpointTest : public dtp::test::TempDirTest {
 protected:
  // A 1-device run saved after kSaveAfter steps.
  std::string savedOnOneDevice(const std::string& name) {
    const std::string path = file(name);
    Llama model(small_llama_config());
    auto opt = adamw(model);
    train_llama(model, *opt, 0, kSaveAfter);
    save_checkpoint(path, model, *opt, kSaveAfter);
    return path;
  }
};

TEST_F(CheckpointTest, SavedAtTpTwoResumesOnOneDevice) {
  const Reference want = reference();
  for (bool sp : {true, false}) {
    SCOPED_TRACE(std::string("sp=") + (sp ? "1" : "0"));
    const std::string path = file(std::string("tp2_sp") + (sp ? "1" : "0") + ".safetensors");
    run_ranks(2, [&](int) {
      auto mesh = init_device_mesh("cpu", {2}, {"tp"});
      Llama model(small_llama_config());
      apply_tensor_parallel(model, mesh, TensorParallelOptions{sp, kSeq});
      auto opt = adamw(model);
      const auto losses = train_llama(model, *opt, 0, kSaveAfter);
      for (int i = 0; i < kSaveAfter; ++i) EXPECT_NEAR(losses[i], want.losses[i], kTol) << "step " << i;
      save_checkpoint(path, model, *opt, kSaveAfter);
    });
    Llama model(small_llama_config());
    auto opt = adamw(model);
    EXPECT_EQ(load_checkpoint(path, model, opt.get()), kSaveAfter);
    expectStateAtSaveStep(model, *opt);
    const auto losses = train_llama(model, *opt, kSaveAfter, kSteps);
    expectResumedLikeReference(losses, full_named_params(model), want);
  }
}

TEST_F(CheckpointTest, SavedOnOneDeviceResumesAtTpTwo) {
  const Reference want = reference();
  const std::string path = savedOnOneDevice("tp1.safetensors");
  for (bool sp : {true, false}) {
    SCOPED_TRACE(std::string("sp=") + (sp ? "1" : "0"));
    run_ranks(2, [&](int) {
      auto mesh = init_device_mesh("cpu", {2}, {"tp"});
      Llama model(small_llama_config());
      apply_tensor_parallel(model, mesh, TensorParallelOptions{sp, kSeq});
      auto opt = adamw(model);
      EXPECT_EQ(load_checkpoint(path, model, opt.get()), kSaveAfter);
      expectStateAtSaveStep(model, *opt);
      EXPECT_TRUE(is_dtensor(model->output->weight));  // still sharded after the load
      const auto losses = train_llama(model, *opt, kSaveAfter, kSteps);
      expectResumedLikeReference(losses, full_named_params(model), want);
    });
  }
}

// The control for the two tests above: the same resume with a fresh AdamW
// state matches step 3 (parameters alone fix its loss) but not step 4, so
// their step-4 agreement comes from the restored moments and step counts.
TEST_F(CheckpointTest, ResumeWithoutOptimizerStateDiverges) {
  const Reference want = reference();
  const std::string path = savedOnOneDevice("tp1.safetensors");
  Llama model(small_llama_config());
  auto opt = adamw(model);
  EXPECT_EQ(load_checkpoint(path, model, /*optimizer=*/nullptr), kSaveAfter);
  EXPECT_TRUE(opt->state().empty());
  const auto losses = train_llama(model, *opt, kSaveAfter, kSteps);
  EXPECT_NEAR(losses[0], want.losses[kSaveAfter], kTol);
  EXPECT_GT(std::abs(losses[1] - want.losses[kSaveAfter + 1]), 100 * kTol);
}

TEST_F(CheckpointTest, TruncatedFileIsNamedAndChangesNothing) {
  const std::string good = savedOnOneDevice("good.safetensors");
  const std::string bytes = dtp::test::read_bytes(good);
  ASSERT_GT(bytes.size(), 8u);
  uint64_t header = 0;
  for (int b = 7; b >= 0; --b) header = (header << 8) | static_cast<unsigned char>(bytes[b]);
  const uint64_t data = bytes.size() - 8 - header;
  ASSERT_GT(data, 0u);

  Trained t = otherInitOneStep();
  Llama& model = t.model;
  auto& opt = t.opt;
  const Snapshot before = snapshot(model, *opt);

  const std::string cut = file("cut.safetensors");
  for (uint64_t size : {uint64_t{0}, uint64_t{5}, uint64_t{8}, 8 + header / 2, 8 + header, 8 + header + data / 2,
                        uint64_t{bytes.size()} - 1}) {
    SCOPED_TRACE("cut at " + std::to_string(size) + " of " + std::to_string(bytes.size()) + " bytes");
    dtp::test::write_bytes(cut, bytes.substr(0, size));
    ASSERT_EQ(fs::file_size(cut), size);
    const std::string err = dtp::test::any_error_of([&] { load_checkpoint(cut, model, opt.get()); });
    EXPECT_NE(err.find(cut), std::string::npos) << err;
    EXPECT_NE(err.find("truncated"), std::string::npos) << err;
    expectSame(snapshot(model, *opt), before);
  }
  // The intact file loads into the same model: the failures were the cuts.
  EXPECT_EQ(load_checkpoint(good, model, opt.get()), kSaveAfter);
  EXPECT_FALSE(snapshot(model, *opt).params.front().equal(before.params.front()));
}

TEST_F(CheckpointTest, OtherModelSizeIsNamedAndChangesNothing) {
  const std::string path = savedOnOneDevice("dim32.safetensors");
  LlamaConfig c = small_llama_config();
  c.dim = 48;  // head_dim 12
  Llama model(c);
  auto opt = adamw(model);
  const Snapshot before = snapshot(model, *opt);
  const std::string err = dtp::test::any_error_of([&] { load_checkpoint(path, model, opt.get()); });
  EXPECT_NE(err.find(path), std::string::npos) << err;
  EXPECT_NE(err.find("dim=32"), std::string::npos) << err;
  EXPECT_NE(err.find("dim=48"), std::string::npos) << err;
  expectSame(snapshot(model, *opt), before);
}

// A well-formed safetensors file with a bad value that only load_checkpoint
// can judge: the step metadata, or the step count of the last parameter's
// AdamW state (read after every other parameter would have been copied).
TEST_F(CheckpointTest, CorruptStepIsNamedAndChangesNothing) {
  const std::string good = savedOnOneDevice("good.safetensors");
  Trained t = otherInitOneStep();
  Llama& model = t.model;
  auto& opt = t.opt;
  const Snapshot before = snapshot(model, *opt);

  const std::string last = "adamw." + model->unique_named_parameters().back().first + ".step";
  for (int variant = 0; variant < 2; ++variant) {
    io::Checkpoint ck = io::load_safetensors(good);
    if (variant == 0) {
      ck.metadata["step"] = "two";
    } else {
      auto it = std::find_if(ck.tensors.begin(), ck.tensors.end(), [&](const auto& t) { return t.first == last; });
      ASSERT_NE(it, ck.tensors.end());
      it->second = at::zeros({2}, at::kLong);
    }
    const std::string path = file("corrupt" + std::to_string(variant) + ".safetensors");
    io::save_safetensors(path, ck.tensors, ck.metadata);
    const std::string err = dtp::test::any_error_of([&] { load_checkpoint(path, model, opt.get()); });
    EXPECT_NE(err.find(path), std::string::npos) << err;
    EXPECT_NE(err.find(variant == 0 ? "'two'" : last), std::string::npos) << err;
    expectSame(snapshot(model, *opt), before);
  }
}

TEST_F(CheckpointTest, MissingFileIsNamed) {
  const std::string path = file("never_saved.safetensors");
  Llama model(small_llama_config());
  auto opt = adamw(model);
  const Snapshot before = snapshot(model, *opt);
  const std::string err = dtp::test::any_error_of([&] { load_checkpoint(path, model, opt.get()); });
  EXPECT_NE(err.find(path), std::string::npos) << err;
  expectSame(snapshot(model, *opt), before);
}

// The save cannot create its temporary file (a directory is in the way, as
// after a crash that left debris; root ignores permission bits, so chmod
// would not do): the error names the path and the old file stays intact.
TEST_F(CheckpointTest, FailedSaveKeepsThePreviousFile) {
  const std::string path = file("ck.safetensors");
  Llama model(small_llama_config());
  auto opt = adamw(model);
  train_llama(model, *opt, 0, kSaveAfter);
  save_checkpoint(path, model, *opt, kSaveAfter);
  const std::string old = dtp::test::read_bytes(path);
  ASSERT_FALSE(old.empty());

  train_llama(model, *opt, kSaveAfter, kSaveAfter + 1);
  const fs::path blocker = path + ".tmp." + std::to_string(::getpid());
  fs::create_directory(blocker);
  const std::string err = dtp::test::any_error_of([&] { save_checkpoint(path, model, *opt, kSaveAfter + 1); });
  EXPECT_NE(err.find(path), std::string::npos) << err;
  EXPECT_EQ(dtp::test::read_bytes(path), old);
  {
    Llama fresh(small_llama_config());
    EXPECT_EQ(load_checkpoint(path, fresh, nullptr), kSaveAfter);
  }
  fs::remove(blocker);

  // A save into a directory that does not exist fails the same way and
  // leaves nothing behind.
  const std::string nowhere = file("gone/ck.safetensors");
  EXPECT_NE(dtp::test::any_error_of([&] { save_checkpoint(nowhere, model, *opt, kSaveAfter + 1); }).find(nowhere), std::string::npos);
  EXPECT_FALSE(fs::exists(file("gone")));

  // With the obstacle gone the same save succeeds and replaces the file.
  save_checkpoint(path, model, *opt, kSaveAfter + 1);
  EXPECT_NE(dtp::test::read_bytes(path), old);
  Llama fresh(small_llama_config());
  EXPECT_EQ(load_checkpoint(path, fresh, nullptr), kSaveAfter + 1);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()), 1);  // no temporary file left
}

}  // namespace
