#include "dtp/tp/parallelize.h"

#include "dtensor/rules_agree.h"
#include "dtp/module_utils.h"
#include "nn/applied.h"

#include <torch/nn/module.h>

#include <fnmatch.h>

namespace dtp {
namespace {

thread_local std::optional<DeviceMesh> current_mesh;

std::vector<std::string> atoms(const std::string& fqn) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    auto dot = fqn.find('.', start);
    out.push_back(fqn.substr(start, dot - start));
    if (dot == std::string::npos) return out;
    start = dot + 1;
  }
}

// "layers.*.attention.wq" matches "layers.3.attention.wq": atom by atom.
bool matches(const std::string& pattern, const std::string& fqn) {
  const auto p = atoms(pattern), n = atoms(fqn);
  if (p.size() != n.size()) return false;
  for (size_t i = 0; i < p.size(); ++i)
    if (fnmatch(p[i].c_str(), n[i].c_str(), 0) != 0) return false;
  return true;
}

// Tensor parallelism comes first (torchtitan: TP, then AC, then FSDP/DDP):
// data parallelism has replaced the parameters that the styles would shard.
void checkNotDataParallel(torch::nn::Module& module) {
  const std::string dp = detail::applied_below(module, {detail::technique::kFullyShard, detail::technique::kReplicate});
  TORCH_CHECK(dp.empty(), "parallelize_module: ", module.name(), " (or a module inside it) is already under ", dp,
              "(). Apply tensor parallelism first, then ", dp, ", on a fresh model.");
}

void checkMesh(const DeviceMesh& mesh) {
  TORCH_CHECK(mesh.valid(), "parallelize_module: invalid DeviceMesh.");
  TORCH_CHECK(mesh.ndim() == 1, "parallelize_module: tensor parallelism needs a 1-D mesh, got ",
              mesh.str(), ". Slice the tensor-parallel dimension by name, e.g. mesh[\"tp\"].");
}

// Applies `style` to `m`, then hands each parameter it replaced to every other
// module of `root` that held the same tensor, so tied weights stay tied (a
// Rowwise Embedding and a Colwise output Linear sharing one Shard(0) weight).
void applyKeepingTies(torch::nn::Module& root, torch::nn::Module& m, const std::string& fqn,
                      const ParallelStyle& style, const DeviceMesh& mesh, std::optional<int> src) {
  std::vector<std::pair<std::string, at::Tensor>> before;
  for (const auto& p : m.named_parameters(/*recurse=*/false)) before.emplace_back(p.key(), p.value());
  style.apply(m, fqn, mesh, src);
  const auto after = m.named_parameters(/*recurse=*/false);
  for (const auto& [name, old] : before) {
    const at::Tensor* now = after.find(name);
    if (now == nullptr || now->is_same(old)) continue;
    for (const auto& other : root.modules(/*include_self=*/true)) {
      for (const auto& q : other->named_parameters(/*recurse=*/false))
        if (q.value().is_same(old)) set_parameter(*other, q.key(), *now);
    }
  }
}

}  // namespace

void parallelize_module(torch::nn::Module& module, const DeviceMesh& mesh, const ParallelStyle& style,
                        std::optional<int> src_data_rank) {
  checkMesh(mesh);
  checkNotDataParallel(module);
  check_sharding_rules_agree(mesh, "parallelize_module");  // NOTE: [Ranks agree on sharding rules]
  applyKeepingTies(module, module, "", style, mesh, src_data_rank);
}

void parallelize_module(torch::nn::Module& module, const DeviceMesh& mesh,
                        const ParallelizePlan& plan, std::optional<int> src_data_rank) {
  checkMesh(mesh);
  checkNotDataParallel(module);
  const auto modules = module.named_modules("", /*include_self=*/false);
  // Check every entry before changing anything.
  std::vector<std::vector<std::pair<std::string, torch::nn::Module*>>> targets;
  for (const auto& entry : plan) {
    targets.emplace_back();
    if (entry.pattern.empty()) targets.back().emplace_back("", &module);  // the module itself
    for (const auto& item : modules)
      if (!entry.pattern.empty() && matches(entry.pattern, item.key()))
        targets.back().emplace_back(item.key(), item.value().get());
    if (targets.back().empty()) {
      std::vector<std::string> names;
      for (const auto& item : modules) names.push_back(item.key());
      if (names.size() > 24) {
        names.resize(24);
        names.push_back("...");
      }
      TORCH_CHECK(false, "parallelize_module: plan entry '", entry.pattern, "' (",
                  entry.style->name(), ") matches no submodule of ", module.name(),
                  ". Its submodules are: ", c10::Join(", ", names),
                  ". Fix the pattern or drop the entry.");
    }
  }
  check_sharding_rules_agree(mesh, "parallelize_module");  // NOTE: [Ranks agree on sharding rules]
  for (size_t i = 0; i < plan.size(); ++i)
    for (auto& [fqn, m] : targets[i]) applyKeepingTies(module, *m, fqn, *plan[i].style, mesh, src_data_rank);
}

namespace {

DeviceMesh currentMesh() {
  auto mesh = DeviceMeshGuard::current();
  TORCH_CHECK(mesh.has_value(), "parallelize_module: no mesh given and no dtp::DeviceMeshGuard "
              "is active on this thread. Pass the mesh, or create a DeviceMeshGuard(mesh[\"tp\"]).");
  return *mesh;
}

}  // namespace

void parallelize_module(torch::nn::Module& module, const ParallelizePlan& plan,
                        std::optional<int> src_data_rank) {
  parallelize_module(module, currentMesh(), plan, src_data_rank);
}

void parallelize_module(torch::nn::Module& module, const ParallelStyle& style, std::optional<int> src_data_rank) {
  parallelize_module(module, currentMesh(), style, src_data_rank);
}

void parallelize_module(torch::nn::Module& module, std::optional<DeviceMesh> mesh) {
  checkMesh(mesh ? *mesh : currentMesh());
  TORCH_WARN("parallelize_module: no parallelize_plan was given for ", module.name(),
             ", so this call does nothing (as PyTorch's). Pass a plan or a style.");
}

DeviceMeshGuard::DeviceMeshGuard(DeviceMesh mesh) : prev_(current_mesh) { current_mesh = std::move(mesh); }
DeviceMeshGuard::~DeviceMeshGuard() { current_mesh = prev_; }
std::optional<DeviceMesh> DeviceMeshGuard::current() { return current_mesh; }

}  // namespace dtp
