// all_to_all with uneven per-peer counts through shared memory: expert
// parallelism's token dispatch and combine (ProcessGroup::all_to_all_single)
// at memory speed on one host.
//
// NOTE: [Shared-memory all_to_all] The counts differ between ranks, so no
// rank alone can tell whether every rank's pieces fit its slot, and the
// path must be chosen alike on every member. Two rounds (NOTE: [Shared-memory
// collectives]):
//   - counts: each rank publishes its send and receive counts (2 W int64);
//     every rank reads the whole W x W exchange, checks that what p sends q
//     is what q expects from p (else the same error on every rank), and
//     declines on every rank when some rank sends more than a slot holds
//     (c10d then carries it);
//   - pieces: each rank publishes its send buffer; rank me reads rank r's
//     piece for it at offset sum(send_r[0..me)), which round one told it.
// Example, 2 ranks, rank 0 sends [1, 3] rows of 4 floats, rank 1 [2, 0]:
// rank 0 reads 4 floats at 0 of its own slot and 8 at 0 of rank 1's; rank 1
// reads 12 floats at 4 of rank 0's slot and nothing of its own.
#include "comm/shm_group.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstring>

namespace dtp::detail {

bool ShmGroup::all_to_all(const at::Tensor& flat, const std::vector<int64_t>& send, const std::vector<int64_t>& recv,
                          at::Tensor& out) {
  const int W = size_;
  const int64_t el = flat.element_size();
  if (static_cast<int64_t>(2 * W * sizeof(int64_t)) > slot_bytes_) return false;  // the same on every member
  at::Tensor counts = at::empty({2 * W}, at::kLong);
  std::memcpy(counts.data_ptr<int64_t>(), send.data(), W * sizeof(int64_t));
  std::memcpy(counts.data_ptr<int64_t>() + W, recv.data(), W * sizeof(int64_t));
  const uint32_t seq = publish(counts, shm_call_hash({9, static_cast<int64_t>(flat.scalar_type())}));
  // Read now: this buffer is written again two collectives on.
  std::vector<int64_t> offset(W, 0);  // of this rank's piece in rank r's send buffer
  bool fits = true;
  for (int p = 0; p < W; ++p) {
    const auto* row = reinterpret_cast<const int64_t*>(slot(p, seq));
    int64_t total = 0;
    for (int q = 0; q < W; ++q) {
      const int64_t expected = reinterpret_cast<const int64_t*>(slot(q, seq))[W + p];
      TORCH_CHECK(row[q] == expected, "shared-memory collective: the ranks disagree on an all_to_all's counts: "
                  "group rank ", p, " sends ", row[q], " elements to group rank ", q, ", which expects ", expected,
                  ". Rerun with TORCH_DISTRIBUTED_DEBUG=DETAIL to see each rank's call");
      if (q < rank_) offset[p] += row[q];
      total += row[q];
    }
    fits = fits && total * el <= slot_bytes_;
  }
  if (!fits) return false;
  TORCH_INTERNAL_ASSERT(flat.is_contiguous() && out.is_contiguous());
  const uint32_t data = publish(flat, shm_call_hash({10, static_cast<int64_t>(flat.scalar_type())}));
  auto* dst = static_cast<uint8_t*>(out.data_ptr());
  for (int r = 0; r < W; ++r) {
    if (recv[r] > 0) std::memcpy(dst, slot(r, data) + offset[r] * el, recv[r] * el);
    dst += recv[r] * el;
  }
  return true;
}

}  // namespace dtp::detail
