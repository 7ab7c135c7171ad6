#include "dtp/inference/kv_cache.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace dtp::inference {
namespace {
thread_local KVCache* tActive = nullptr;

at::Tensor boolTensor(const std::vector<uint8_t>& v, int64_t rows, int64_t cols) {
  return at::tensor(v, at::kByte).to(at::kBool).view({rows, cols});
}
}  // namespace

KVCache::KVCache(int64_t max_batch, int64_t max_seq) : max_batch_(max_batch), max_seq_(max_seq) {
  TORCH_CHECK(max_batch > 0 && max_seq > 0, "KVCache: max_batch=", max_batch, " and max_seq=", max_seq,
              " must be positive.");
}

KVCache KVCache::paged(int64_t num_blocks, int64_t block_size) {
  TORCH_CHECK(num_blocks > 0 && block_size > 0, "KVCache::paged: num_blocks=", num_blocks, " and block_size=",
              block_size, " must be positive.");
  KVCache c(1, 1);
  c.max_batch_ = c.max_seq_ = 0;
  c.num_blocks_ = num_blocks;
  c.block_size_ = block_size;
  return c;
}

void KVCache::set_batch(std::vector<std::vector<int64_t>> tables, std::vector<int64_t> lengths, bool packed) {
  TORCH_CHECK(is_paged(), "KVCache::set_batch: this cache is contiguous. Build it with KVCache::paged(num_blocks, "
              "block_size), or use reset(batch).");
  TORCH_CHECK(!tables.empty() && tables.size() == lengths.size(), "KVCache::set_batch: got ", tables.size(),
              " block tables and ", lengths.size(), " lengths, expected one of each per sequence (at least one).");
  for (size_t b = 0; b < tables.size(); ++b) {
    for (int64_t block : tables[b])
      TORCH_CHECK(block >= 0 && block < num_blocks_, "KVCache::set_batch: sequence ", b, " holds block ", block,
                  ", expected blocks in [0, ", num_blocks_, ").");
    TORCH_CHECK(lengths[b] >= 0 && lengths[b] <= static_cast<int64_t>(tables[b].size()) * block_size_,
                "KVCache::set_batch: sequence ", b, " has ", lengths[b], " tokens in ", tables[b].size(),
                " blocks of ", block_size_, ". Give it enough blocks.");
  }
  tables_ = std::move(tables);
  lengths_ = std::move(lengths);
  packed_ = packed;
}

void KVCache::shard_blocks(ProcessGroup group) {
  TORCH_CHECK(is_paged(), "KVCache::shard_blocks: this cache is contiguous; only a paged cache spreads its blocks over "
              "ranks. Build it with KVCache::paged(num_blocks, block_size).");
  TORCH_CHECK(group.valid(), "KVCache::shard_blocks: an invalid group (this rank is not a member). Give the group of "
              "ranks that run the same forwards (the model's cp group).");
  TORCH_CHECK(std::none_of(k_.begin(), k_.end(), [](const at::Tensor& t) { return t.defined(); }),
              "KVCache::shard_blocks: the cache has allocated its layers already. Shard it before its first forward.");
  shard_rank_ = group.rank();
  shards_ = group.size();
  shard_group_ = std::move(group);
}

int64_t KVCache::localSlot(const std::vector<int64_t>& table, int64_t j) const {
  const int64_t block = table[j / block_size_];
  if (block % shards_ != shard_rank_) return -1;
  return block / shards_ * block_size_ + j % block_size_;
}

void KVCache::reset(int64_t batch) {
  TORCH_CHECK(!is_paged(), "KVCache::reset: a paged cache takes its batch from set_batch(tables, lengths).");
  TORCH_CHECK(batch > 0 && batch <= max_batch_, "KVCache: a batch of ", batch, " sequences, but the cache holds ",
              max_batch_, " (max_batch). Build the cache with max_batch >= ", batch, ", or split the batch.");
  lengths_.assign(batch, 0);
}

void KVCache::keep(const std::vector<int64_t>& rows) {
  TORCH_CHECK(!is_paged(), "KVCache::keep: a paged cache takes its batch from set_batch(tables, lengths).");
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
    k_[index] = is_paged() ? at::zeros({local_blocks() * block_size_, like.size(2), like.size(3)}, like.options())
                           : at::zeros({max_batch_, max_seq_, like.size(2), like.size(3)}, like.options());
    v_[index] = at::zeros_like(k_[index]);
  }
  const at::Tensor& k = k_[index];
  const int64_t d = k.dim();  // [.., kv_heads, head_dim]
  TORCH_CHECK(k.size(d - 2) == like.size(2) && k.size(d - 1) == like.size(3) && k.scalar_type() == like.scalar_type() &&
                  k.device() == like.device(),
              "KVCache: layer ", index, " holds ", k.size(d - 2), " KV heads of head_dim ", k.size(d - 1), " in ",
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
  step_.groups.clear();
  if (packed_) {
    packedSteps(valid);
    return;
  }
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(valid[b] >= 1 && valid[b] <= seq, "KVCache: sequence ", b, " has ", valid[b], " valid tokens in a call of ",
                seq, ". Each sequence needs 1..", seq, " (an empty prompt cannot start a generation).");
    if (is_paged()) {
      const int64_t room = static_cast<int64_t>(tables_[b].size()) * block_size_;
      TORCH_CHECK(lengths_[b] + valid[b] <= room, "KVCache: sequence ", b, " would reach ", lengths_[b] + valid[b],
                  " tokens (", lengths_[b], " cached + ", valid[b], " in this call), but its ", tables_[b].size(),
                  " blocks hold ", room, ". Give it more blocks in set_batch.");
      step_.keys = std::max(step_.keys, lengths_[b] + valid[b]);  // See NOTE: [Paged padding].
      continue;
    }
    TORCH_CHECK(lengths_[b] + seq <= max_seq_, "KVCache: sequence ", b, " would reach ", lengths_[b] + seq,
                " tokens (", lengths_[b], " cached + ", seq, " in this call), but the cache holds ", max_seq_,
                " (max_seq). Build the cache with a larger max_seq (at most the model's max_seq_len), or use a "
                "shorter prompt or fewer new tokens.");
    step_.keys = std::max(step_.keys, lengths_[b] + seq);
  }
  at::Tensor start = at::tensor(lengths_, at::kLong).view({batch, 1});
  step_.positions = start + at::arange(seq, at::kLong).view({1, seq});
  if (is_paged()) {
    // NOTE: [Paged padding] A paged call batches sequences at any lengths
    // (a prompt's next chunk beside another's first), so its right padding
    // could run past the model's positions: 200 cached + 50 valid beside a
    // 64-token chunk would pad to position 263 of a 256-position model.
    // Padding is never cached and its outputs are dropped, so it takes its
    // sequence's last valid position, and keys = max(lengths[b] + valid[b]).
    const at::Tensor last = at::tensor(valid, at::kLong).view({batch, 1}) - 1;
    step_.positions = start + at::minimum(at::arange(seq, at::kLong).view({1, seq}), last);
    pagedSlots(valid, seq);
  }
}

// See NOTE: [Paged KV cache] (and [KV cache sharded over cp]).
void KVCache::pagedSlots(const std::vector<int64_t>& valid, int64_t seq) {
  const int64_t batch = static_cast<int64_t>(valid.size()), keys = step_.keys;
  std::vector<int64_t> rows, slots, read(batch * keys, 0);
  std::vector<uint8_t> held(is_sharded() ? batch * keys : 0, 0);
  bool all = !is_sharded();
  for (int64_t b = 0; b < batch; ++b) {
    const std::vector<int64_t>& table = tables_[b];
    const int64_t start = lengths_[b], end = start + valid[b];
    for (int64_t s = 0; s < seq; ++s) {
      const int64_t slot = s < valid[b] ? localSlot(table, start + s) : -1;
      if (slot < 0) {
        all = false;
        continue;
      }
      rows.push_back(b * seq + s);
      slots.push_back(slot);
    }
    for (int64_t j = 0; j < end; ++j) {
      const int64_t slot = localSlot(table, j);
      if (slot < 0) continue;
      read[b * keys + j] = slot;
      if (is_sharded()) held[b * keys + j] = 1;
    }
  }
  step_.write_rows = all ? at::Tensor() : at::tensor(rows, at::kLong);
  step_.write_slots = at::tensor(slots, at::kLong);
  step_.read_slots = at::tensor(read, at::kLong).view({batch, keys});
  step_.read_held = is_sharded() ? boolTensor(held, batch, keys) : at::Tensor();
}

// See NOTE: [Packed batch].
void KVCache::packedSteps(const std::vector<int64_t>& valid) {
  const int64_t batch = static_cast<int64_t>(valid.size()), bs = block_size_;
  std::vector<int64_t> offset(batch, 0), positions, rows, slots;
  int64_t total = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t room = static_cast<int64_t>(tables_[b].size()) * bs;
    TORCH_CHECK(valid[b] >= 1 && lengths_[b] + valid[b] <= room, "KVCache: packed sequence ", b, " has ", valid[b],
                " tokens after ", lengths_[b], " cached, in ", tables_[b].size(), " blocks of ", bs, ": expected 1 or "
                "more tokens that fit its blocks. Give it more blocks in set_batch.");
    offset[b] = total;
    total += valid[b];
    for (int64_t s = 0; s < valid[b]; ++s) {
      const int64_t j = lengths_[b] + s, slot = localSlot(tables_[b], j);
      positions.push_back(j);
      if (slot < 0) continue;
      rows.push_back(offset[b] + s);
      slots.push_back(slot);
    }
    step_.keys = std::max(step_.keys, lengths_[b] + valid[b]);
  }
  step_.positions = at::tensor(positions, at::kLong).view({1, total});
  step_.write_rows = is_sharded() ? at::tensor(rows, at::kLong) : at::Tensor();
  step_.write_slots = at::tensor(slots, at::kLong);
  step_.read_slots = at::Tensor();
  step_.read_held = at::Tensor();
  for (const bool single : {true, false}) {
    std::vector<int64_t> rows;
    int64_t width = 0, keys = 0;
    for (int64_t b = 0; b < batch; ++b) {
      if ((valid[b] == 1) != single) continue;
      rows.push_back(b);
      width = std::max(width, valid[b]);
      keys = std::max(keys, lengths_[b] + valid[b]);
    }
    if (rows.empty()) continue;
    const int64_t g = static_cast<int64_t>(rows.size());
    std::vector<int64_t> gather, pos, read(g * keys, 0), real, dest;
    std::vector<uint8_t> held(is_sharded() ? g * keys : 0, 0);
    for (int64_t i = 0; i < g; ++i) {
      const int64_t b = rows[i];
      for (int64_t s = 0; s < width; ++s) {
        const int64_t k = std::min(s, valid[b] - 1);  // padding repeats the last token
        gather.push_back(offset[b] + k);
        pos.push_back(lengths_[b] + k);
        if (s < valid[b]) {
          real.push_back(i * width + s);
          dest.push_back(offset[b] + s);
        }
      }
      for (int64_t j = 0; j < lengths_[b] + valid[b]; ++j) {
        const int64_t slot = localSlot(tables_[b], j);
        if (slot < 0) continue;
        read[i * keys + j] = slot;
        if (is_sharded()) held[i * keys + j] = 1;
      }
    }
    Step::Group group;
    group.keys = keys;
    group.gather = at::tensor(gather, at::kLong).view({g, width});
    group.positions = at::tensor(pos, at::kLong).view({g, width});
    group.read = at::tensor(read, at::kLong).view({g, keys});
    if (is_sharded()) group.held = boolTensor(held, g, keys);
    group.valid = at::tensor(real, at::kLong);
    group.dest = at::tensor(dest, at::kLong);
    step_.groups.push_back(std::move(group));
  }
}

void KVCache::end(const std::vector<int64_t>& valid) {
  for (size_t b = 0; b < valid.size(); ++b) lengths_[b] += valid[b];
}

KVCache* KVCache::active() { return tActive; }

KVCache::Activate::Activate(KVCache* c) : prev(tActive) { tActive = c; }
KVCache::Activate::~Activate() { tActive = prev; }

}  // namespace dtp::inference
