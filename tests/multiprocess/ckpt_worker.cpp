// The rank program of the multi-process checkpoint tests (one process per
// rank, so each rank's memory is its own). argv[1] picks the scenario, argv[2]
// is the checkpoint folder:
//   memory       4 ranks: a 256 MiB MLP (4 Linear 4096x4096, float32) under
//                TP=4, 64 MiB per rank. Saved Colwise/Rowwise, loaded into
//                the plan swapped (every rank reads parts of every piece).
//                Prints each rank's peak RSS above its resident size before
//                the call (VmHWM after clear_refs), and checks it against
//                LoadOptions' 16 MiB buffer + 16 MiB of allocator slack.
//   crash        2 ranks: save v1, then while saving v2 rank 1 kills itself
//                (SIGKILL) as soon as its file is being written.
//   crash-check  one process: the folder still loads, with v1's values;
//                what is left in "<dir>.incomplete" is dtp's, and the next
//                save replaces the checkpoint.
// Rank 0 prints "<scenario> ok" when every check held; a failed check exits 1.
#include <dtp/dcp/checkpoint.h>
#include <dtp/dtensor.h>
#include <dtp/nn/modules.h>
#include <dtp/tp/parallelize.h>

#include <ATen/ATen.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>

using namespace dtp;

namespace {

struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(int64_t layers, int64_t width) {
    for (int64_t i = 0; i < layers; ++i) {
      fc.push_back(register_module("fc" + std::to_string(i),
                                   dtp::nn::Linear(torch::nn::LinearOptions(width, width).bias(false))));
    }
  }
  std::vector<dtp::nn::Linear> fc;
};
DTP_MODULE(Mlp);

// Every rank builds the same weights (one seed), then keeps its shards.
Mlp build(int64_t layers, int64_t width, const DeviceMesh* mesh, bool swapped) {
  at::manual_seed(1234);
  torch::NoGradGuard no_grad;
  Mlp m(layers, width);
  if (mesh == nullptr) return m;
  ParallelizePlan plan;
  for (int64_t i = 0; i < layers; ++i) {
    const bool colwise = (i % 2 == 0) != swapped;
    if (colwise) plan.emplace_back("fc" + std::to_string(i), ColwiseParallel());
    else plan.emplace_back("fc" + std::to_string(i), RowwiseParallel());
  }
  parallelize_module(*m, *mesh, plan);
  return m;
}

double statusMiB(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string key;
  double kb = 0;
  while (in >> key) {
    if (key == field) {
      in >> kb;
      return kb / 1024.0;
    }
    in.ignore(1 << 20, '\n');
  }
  return 0;
}

// Peak RSS while `f` runs, above the resident size just before it.
template <class F>
double peakAbove(F f) {
  std::ofstream("/proc/self/clear_refs") << "5";  // resets VmHWM to VmRSS
  const double before = statusMiB("VmRSS:");
  f();
  return statusMiB("VmHWM:") - before;
}

void check(bool ok, const std::string& what) {
  if (!ok) {
    std::cerr << "check failed: " << what << std::endl;
    std::exit(1);
  }
}

int memory(const std::string& dir) {
  ProcessGroup world = init_process_group();
  check(world.size() == 4, "run with 4 ranks");
  auto mesh = init_device_mesh("cpu", {4}, {"tp"});
  constexpr int64_t kLayers = 4, kWidth = 4096;
  Mlp saved = build(kLayers, kWidth, &mesh, /*swapped=*/false);
  Mlp loaded = build(kLayers, kWidth, &mesh, /*swapped=*/true);
  torch::NoGradGuard no_grad;
  for (auto& p : loaded->parameters()) to_local(p).zero_();
  const double fullMiB = kLayers * kWidth * kWidth * 4 / 1048576.0, shardMiB = fullMiB / 4;
  dcp::LoadOptions options;  // the default buffer: 16 MiB
  const double boundMiB = options.buffer_bytes / 1048576.0 + 16;
  const double save = peakAbove([&] { dcp::save_state(dir, *saved, nullptr); });
  const double load = peakAbove([&] { dcp::load_state(dir, *loaded, nullptr, {}, options); });
  for (size_t i = 0; i < saved->fc.size(); ++i) {
    check(full_tensor(saved->fc[i]->weight).equal(full_tensor(loaded->fc[i]->weight)), "fc" + std::to_string(i) + " equal");
  }
  at::Tensor peaks = at::tensor({save, load}, at::kDouble);
  world.all_reduce(peaks, ReduceOp::Max);
  std::printf("rank %d: model %.0f MiB, shard %.0f MiB; peak RSS above resident: save %.1f MiB, load %.1f MiB "
              "(bound %.0f MiB)\n", world.rank(), fullMiB, shardMiB, save, load, boundMiB);
  std::fflush(stdout);
  world.barrier();
  if (world.rank() == 0) {
    const double s = peaks[0].item<double>(), l = peaks[1].item<double>();
    check(s <= boundMiB && l <= boundMiB, "peak RSS within the bound");
    std::printf("memory ok: max over ranks save %.1f MiB, load %.1f MiB above resident, bound %.0f MiB "
                "(%.0fx smaller than the model)\n", s, l, boundMiB, fullMiB / boundMiB);
  }
  return 0;
}

constexpr int64_t kCrashLayers = 2, kCrashWidth = 4096;

int crash(const std::string& dir) {
  ProcessGroup world = init_process_group();
  auto mesh = init_device_mesh("cpu", {world.size()}, {"tp"});
  Mlp m = build(kCrashLayers, kCrashWidth, &mesh, false);
  dcp::save_state(dir, *m, nullptr, {{"version", "1"}});
  torch::NoGradGuard no_grad;
  for (auto& p : m->parameters()) p.add_(1.0);
  std::atomic<bool> stop{false};
  std::thread killer;
  if (world.rank() == 1) {
    // The file save_safetensors writes before its rename: rank 1 is mid-save.
    const std::string tmp = dir + ".incomplete/rank-00001.safetensors.tmp." + std::to_string(::getpid());
    killer = std::thread([&, tmp] {
      struct stat st {};
      while (!stop) {
        if (::stat(tmp.c_str(), &st) == 0) ::kill(::getpid(), SIGKILL);
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
    });
  }
  dcp::save_state(dir, *m, nullptr, {{"version", "2"}});
  stop = true;
  if (killer.joinable()) killer.join();
  std::cerr << "rank " << world.rank() << ": the second save finished; rank 1 was not killed mid-save" << std::endl;
  return 1;
}

int crashCheck(const std::string& dir) {
  // The half-written save stays in "<dir>.incomplete" unless rank 0 cleared
  // it before dtprun stopped it; what is there is dtp's own.
  const std::string staged = dir + ".incomplete";
  std::error_code ec;
  for (std::filesystem::directory_iterator it(staged, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    check(name == ".dtp-writing" || name.rfind("rank-", 0) == 0, "only dtp's entries in " + staged + ", got " + name);
  }
  Mlp m = build(kCrashLayers, kCrashWidth, nullptr, false);
  Mlp v1 = build(kCrashLayers, kCrashWidth, nullptr, false);
  torch::NoGradGuard no_grad;
  for (auto& p : m->parameters()) p.zero_();
  const auto meta = dcp::load_state(dir, *m, nullptr);
  check(meta.at("version") == "1", "the previous checkpoint (version 1) loads");
  for (size_t i = 0; i < m->fc.size(); ++i) check(m->fc[i]->weight.equal(v1->fc[i]->weight), "v1 values");
  // The next save clears the stale staging folder and replaces the checkpoint.
  dcp::save_state(dir, *m, nullptr, {{"version", "3"}});
  check(!std::filesystem::exists(staged) && dcp::read_index(dir).metadata.at("version") == "3",
        "the next save replaces the checkpoint and leaves no staging folder");
  std::printf("crash-check ok: previous checkpoint intact, the next save replaced it\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string cmd = argc > 1 ? argv[1] : "", dir = argc > 2 ? argv[2] : "";
  if (dir.empty()) {
    std::cerr << "usage: ckpt_worker memory|crash|crash-check DIR" << std::endl;
    return 2;
  }
  if (cmd == "memory") return memory(dir);
  if (cmd == "crash") return crash(dir);
  if (cmd == "crash-check") return crashCheck(dir);
  std::cerr << "ckpt_worker: unknown scenario '" << cmd << "'" << std::endl;
  return 2;
}
