// The state DTensor random ops draw from (dtp/random.h, dtensor/random_state.h):
// this thread's seeded generators, their sync across a mesh's ranks, and the
// data-parallel batch. The random-op handlers themselves are sharding rules
// (rules/random.cpp).
#include "dtensor/random_state.h"

#include "dtp/device_mesh.h"
#include "dtp/random.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <functional>
#include <mutex>
#include <optional>
#include <vector>

namespace dtp {
namespace {

thread_local std::optional<uint64_t> thread_seed;      // set by manual_seed on this thread
thread_local std::vector<at::Generator> thread_generators;  // one per device, seeded thread_seed
thread_local ProcessGroup batch_group;  // NOTE: [Random ops under data parallelism]
thread_local RandomMode thread_mode = RandomMode::Global;
// The per-shard stream (NOTE: [Per-shard random numbers] in philox.h): seeded
// by manual_seed, else on first use by ATen's default CPU generator's seed.
thread_local std::optional<detail::PhiloxState> philox;

// NOTE: [Generator sync] Every rank must draw from the same generator state,
// or a replicated random op silently differs between ranks (ranks seeded
// differently, or one that drew extra numbers). As PyTorch's RNG tracker
// does, the first random op on a mesh after each dtp::manual_seed (and the
// first ever) gives every rank the state of the mesh's first rank: one
// broadcast per mesh dim, per device's generator. The decision depends only
// on calls every rank makes alike (manual_seed, random ops on the mesh), so
// ranks agree on it. A generator's state is a CPU tensor (CUDA's is its seed
// and Philox offset), so the broadcast goes through Gloo on any device.
// RandomMode::PerShard's stream (seed, offset) is synced the same way, once
// per mesh and seed epoch, under the key device kMeta: it belongs to no device.
thread_local uint64_t seed_epoch = 0;
thread_local std::vector<detail::GeneratorSync> synced;

// Gives `gen` the state `broadcast` brings (the first rank's), once per
// (who: a mesh, or the dp batch; gen's device; seed epoch).
void syncOnce(at::Generator& gen, const void* who, const std::function<void(at::Tensor&)>& broadcast) {
  const detail::GeneratorSync key{who, gen.device(), seed_epoch};
  if (std::find(synced.begin(), synced.end(), key) != synced.end()) return;
  std::lock_guard<std::mutex> lock(gen.mutex());
  at::Tensor state = gen.get_state();
  broadcast(state);
  gen.set_state(state);
  if (synced.size() >= 64) synced.clear();  // meshes made and dropped in a loop
  synced.push_back(key);
}

const c10::Device kPhiloxKey{c10::kMeta};  // the per-shard stream's GeneratorSync device

detail::PhiloxState& philoxState() {
  if (!philox) philox = detail::PhiloxState{at::detail::getDefaultCPUGenerator().current_seed(), 0};
  return *philox;
}

// Gives the per-shard stream the first rank's seed and offset, once per `who`
// and seed epoch (as syncOnce).
void syncPhiloxOnce(const void* who, const std::function<void(at::Tensor&)>& broadcast) {
  const detail::GeneratorSync key{who, kPhiloxKey, seed_epoch};
  if (std::find(synced.begin(), synced.end(), key) != synced.end()) return;
  detail::PhiloxState& st = philoxState();
  at::Tensor t = at::tensor({static_cast<int64_t>(st.seed), static_cast<int64_t>(st.offset)}, at::kLong);
  broadcast(t);
  st.seed = static_cast<uint64_t>(t[0].item<int64_t>());
  st.offset = static_cast<uint64_t>(t[1].item<int64_t>());
  if (synced.size() >= 64) synced.clear();
  synced.push_back(key);
}

}  // namespace

detail::PhiloxState detail::take_philox(const DeviceMesh* mesh, uint64_t blocks) {
  if (mesh) {
    if (batch_group.valid() && batch_group.size() > 1)
      syncPhiloxOnce(nullptr, [](at::Tensor& t) { batch_group.broadcast(t, 0); });
    syncPhiloxOnce(mesh->id(), [mesh](at::Tensor& t) {
      for (int64_t m = 0; m < mesh->ndim(); ++m)
        if (mesh->size(m) > 1) mesh->get_group(m).broadcast(t, 0);
    });
  }
  PhiloxState& st = philoxState();
  const PhiloxState now = st;
  st.offset += blocks;
  return now;
}

void set_random_mode(RandomMode m) { thread_mode = m; }
RandomMode random_mode() { return thread_mode; }

at::Generator detail::synced_generator(const DeviceMesh& mesh, c10::Device device) {
  at::Generator gen = random_generator(device);
  if (batch_group.valid() && batch_group.size() > 1)
    syncOnce(gen, nullptr, [](at::Tensor& state) { batch_group.broadcast(state, 0); });
  syncOnce(gen, mesh.id(), [&mesh](at::Tensor& state) {
    for (int64_t m = 0; m < mesh.ndim(); ++m)
      if (mesh.size(m) > 1) mesh.get_group(m).broadcast(state, 0);
  });
  return gen;
}

void manual_seed(uint64_t seed) {
  thread_seed = seed;
  thread_generators.clear();  // made again, seeded `seed`, on first use per device
  philox = detail::PhiloxState{seed, 0};
  ++seed_epoch;  // the next random op on each mesh syncs (NOTE: [Generator sync])
}

at::Generator random_generator(c10::Device device) {
  at::Generator device_default = at::globalContext().defaultGenerator(device);
  if (!thread_seed) return device_default;
  for (const auto& g : thread_generators)
    if (g.device() == device_default.device()) return g;
  at::Generator g;
  if (device.is_cpu()) {
    g = at::make_generator<at::CPUGeneratorImpl>(*thread_seed);
  } else {  // a generator of the device's kind (CUDA: Philox), seeded
    g = device_default.clone();
    std::lock_guard<std::mutex> lock(g.mutex());
    g.set_current_seed(*thread_seed);
  }
  thread_generators.push_back(g);
  return g;
}

void detail::set_data_parallel_batch(ProcessGroup dp) { batch_group = std::move(dp); }
ProcessGroup detail::data_parallel_batch() { return batch_group; }

detail::RandomState detail::get_random_state() {
  // ATen's defaults, and this thread's own where manual_seed made them (for
  // the current GPU made now, so that a restore finds it).
  std::vector<at::Generator> gens{at::detail::getDefaultCPUGenerator()};
  if (at::hasCUDA()) gens.push_back(at::globalContext().defaultGenerator(c10::Device(c10::kCUDA)));
  if (thread_seed) {
    gens.push_back(random_generator(c10::kCPU));
    if (at::hasCUDA()) gens.push_back(random_generator(c10::Device(c10::kCUDA)));
  }
  RandomState state{{}, synced, batch_group, thread_mode, philox};
  for (auto& g : gens) {
    std::lock_guard<std::mutex> lock(g.mutex());
    state.generators.emplace_back(g, g.get_state());
  }
  return state;
}

void detail::set_random_state(const RandomState& state) {
  for (auto [g, s] : state.generators) {
    std::lock_guard<std::mutex> lock(g.mutex());
    g.set_state(s);
  }
  synced = state.synced;
  batch_group = state.batch;
  thread_mode = state.mode;
  philox = state.philox;
}

}  // namespace dtp
