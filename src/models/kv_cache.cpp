#include "dtp/models/kv_cache.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace dtp::models {
namespace {
thread_local KVCache* tActive = nullptr;
}  // namespace

KVCache::KVCache(int64_t max_batch, int64_t max_seq) : max_batch_(max_batch), max_seq_(max_seq) {
  TORCH_CHECK(max_batch > 0 && max_seq > 0, "KVCache: max_batch=", max_batch, " and max_seq=", max_seq,
              " must be positive.");
}

void KVCache::reset(int64_t batch) {
  TORCH_CHECK(batch > 0 && batch <= max_batch_, "KVCache: a batch of ", batch, " sequences, but the cache holds ",
              max_batch_, " (max_batch). Build the cache with max_batch >= ", batch, ", or split the batch.");
  lengths_.assign(batch, 0);
}

void KVCache::keep(const std::vector<int64_t>& rows) {
  const int64_t batch = static_cast<int64_t>(lengths_.size()), n = static_cast<int64_t>(rows.size());
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(rows[i] >= 0 && rows[i] < batch && (i == 0 || rows[i] > rows[i - 1]), "KVCache::keep: rows ",
                c10::IntArrayRef(rows), " must be ascending indices into the current batch of ", batch, ".");
  std::vector<int64_t> lengths;
  for (int64_t r : rows) lengths.push_back(lengths_[r]);
  for (std::vector<at::Tensor>* kv : {&k_, &v_}) {
    for (at::Tensor& t : *kv) {
      if (!t.defined()) continue;
      const at::Tensor kept = t.index_select(0, at::tensor(rows, at::kLong).to(t.device()));  // a copy: rows may overlap
      t.narrow(0, 0, n).copy_(kept);
    }
  }
  lengths_ = std::move(lengths);
}

std::pair<at::Tensor, at::Tensor> KVCache::layer(int64_t index, const at::Tensor& like) {
  if (static_cast<int64_t>(k_.size()) <= index) {
    k_.resize(index + 1);
    v_.resize(index + 1);
  }
  if (!k_[index].defined()) {
    k_[index] = at::zeros({max_batch_, max_seq_, like.size(2), like.size(3)}, like.options());
    v_[index] = at::zeros_like(k_[index]);
  }
  const at::Tensor& k = k_[index];
  TORCH_CHECK(k.size(2) == like.size(2) && k.size(3) == like.size(3) && k.scalar_type() == like.scalar_type() &&
                  k.device() == like.device(),
              "KVCache: layer ", index, " holds ", k.size(2), " KV heads of head_dim ", k.size(3), " in ",
              k.scalar_type(), " on ", k.device(), " from the model it was first used with, but this model's are ",
              like.size(2), " of head_dim ", like.size(3), " in ", like.scalar_type(), " on ", like.device(),
              ". Build a KVCache for each model.");
  return {k_[index], v_[index]};
}

void KVCache::begin(const std::vector<int64_t>& valid, int64_t seq) {
  const int64_t batch = static_cast<int64_t>(valid.size());
  TORCH_CHECK(batch == static_cast<int64_t>(lengths_.size()), "KVCache: a forward of ", batch,
              " sequences on a cache of a batch of ", lengths_.size(), ". Call cache.reset(", batch,
              ") to start a new batch.");
  step_.start = lengths_;
  step_.keys = 0;
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(valid[b] >= 1 && valid[b] <= seq, "KVCache: sequence ", b, " has ", valid[b], " valid tokens in a call of ",
                seq, ". Each sequence needs 1..", seq, " (an empty prompt cannot start a generation).");
    TORCH_CHECK(lengths_[b] + seq <= max_seq_, "KVCache: sequence ", b, " would reach ", lengths_[b] + seq,
                " tokens (", lengths_[b], " cached + ", seq, " in this call), but the cache holds ", max_seq_,
                " (max_seq). Build the cache with a larger max_seq (at most the model's max_seq_len), or use a "
                "shorter prompt or fewer new tokens.");
    step_.keys = std::max(step_.keys, lengths_[b] + seq);
  }
  at::Tensor start = at::tensor(lengths_, at::kLong).view({batch, 1});
  step_.positions = start + at::arange(seq, at::kLong).view({1, seq});
}

void KVCache::end(const std::vector<int64_t>& valid) {
  for (size_t b = 0; b < valid.size(); ++b) lengths_[b] += valid[b];
}

KVCache* KVCache::active() { return tActive; }

KVCache::Activate::Activate(KVCache* c) : prev(tActive) { tActive = c; }
KVCache::Activate::~Activate() { tActive = prev; }

}  // namespace dtp::models
