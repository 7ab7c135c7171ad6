#include "memory.h"

#include "comm/compat.h"

#include "dtp/dtensor.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <torch/optim/adamw.h>

#include <atomic>
#include <cstring>

namespace dtp::bench {
namespace {

std::atomic<int64_t> g_live{0}, g_peak{0};

// Forwards to the allocator it replaced; the context of each DataPtr it hands
// out owns the original DataPtr and remembers the size.
class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(size_t n) DTP_ALLOCATE_CONST override {
    auto* ctx = new Block{inner_->allocate(n), static_cast<int64_t>(n)};
    const int64_t now = g_live += ctx->bytes;
    int64_t peak = g_peak.load();
    while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {
    }
    void* data = ctx->inner.get();
    return {data, ctx, &release, ctx->inner.device()};
  }
  // Declared pure virtual from libtorch 2.3 (no `override`: 1.13 lacks it).
  void copy_data(void* dest, const void* src, std::size_t count) const { std::memcpy(dest, src, count); }

 private:
  struct Block {
    c10::DataPtr inner;
    int64_t bytes;
  };
  static void release(void* ctx) {
    auto* block = static_cast<Block*>(ctx);
    g_live -= block->bytes;
    delete block;
  }
  c10::Allocator* inner_;
};

int64_t localBytes(const at::Tensor& t) {
  const at::Tensor local = is_dtensor(t) ? to_local(t) : t;
  return local.numel() * static_cast<int64_t>(local.element_size());
}

}  // namespace

void install_memory_tracker() {
  static CountingAllocator counting(c10::GetCPUAllocator());
  c10::SetCPUAllocator(&counting, /*priority=*/100);
}

int64_t live_bytes() { return g_live.load(); }
int64_t peak_bytes() { return g_peak.load(); }
void reset_peak() { g_peak = g_live.load(); }

void StateBytes::add(const at::Tensor& t) {
  if (!t.defined()) return;
  const int64_t b = localBytes(t);
  total += b;
  bool whole = true;
  if (is_dtensor(t))
    for (const auto& p : placements(t)) whole &= p.is_replicate();
  if (whole) replicated += b;
}

ModelMemory state_memory(const std::vector<at::Tensor>& params, torch::optim::Optimizer& opt) {
  ModelMemory m;
  for (const auto& p : params) {
    m.params.add(p);
    m.grads.add(p.grad());
  }
  for (const auto& kv : opt.state()) {
    const auto& s = static_cast<const torch::optim::AdamWParamState&>(*kv.second);
    m.optimizer.add(s.exp_avg());
    m.optimizer.add(s.exp_avg_sq());
    m.optimizer.add(s.max_exp_avg_sq());
  }
  return m;
}

}  // namespace dtp::bench
