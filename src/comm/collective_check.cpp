#include "comm/collective_check.h"

#include <ATen/ATen.h>
#include <c10/util/irange.h>

#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>

namespace dtp {

namespace {

constexpr int64_t kCallBytes = 240;  // a call's description, truncated
static_assert(kCallBytes % 8 == 0, "each rank's row of the check's all_gather starts 8-byte aligned");

at::Tensor allGatherRows(const ProcessGroup::Impl& g, const WireContract& c, const at::Tensor& mine) {
  at::Tensor out = at::empty({g.size, mine.numel()}, mine.options());
  std::vector<std::vector<at::Tensor>> outs(1);
  for (int r = 0; r < g.size; ++r) outs[0].push_back(out[r]);
  std::vector<at::Tensor> ins{mine};
  auto work = issue_on_backend(g, mine, [&](compat::Backend& b) { return b.allgather(outs, ins); });
  try {
    work->wait();
  } catch (const std::exception& e) {
    explain_failure(g, c10::str("the check (TORCH_DISTRIBUTED_DEBUG=DETAIL) of ", c.what), g.collectives + 1, e);
  }
  return out;
}

}  // namespace

void check_collective(const ProcessGroup::Impl& g, const WireContract& c) {
  if (!g.options.check_collectives || g.size == 1) return;
  const int W = g.size;
  std::vector<int64_t> head{static_cast<int64_t>(std::hash<std::string>{}(c.what) >> 1),
                            static_cast<int64_t>(c.dtype)};
  head.insert(head.end(), c.send.begin(), c.send.end());
  head.insert(head.end(), c.recv.begin(), c.recv.end());
  // One all_gather of each rank's head, then its call's text (two before:
  // every checked collective paid a second round trip).
  const int64_t headBytes = static_cast<int64_t>(head.size() * sizeof(int64_t));
  at::Tensor mine = at::zeros({headBytes + kCallBytes}, at::kByte);
  std::memcpy(mine.data_ptr<uint8_t>(), head.data(), headBytes);
  std::memcpy(mine.data_ptr<uint8_t>() + headBytes, c.call.data(), std::min<size_t>(c.call.size(), kCallBytes));
  const at::Tensor rows = allGatherRows(g, c, mine);

  // Rows are headBytes + kCallBytes long, both multiples of 8: each head is aligned.
  auto row = [&](int r) { return reinterpret_cast<const int64_t*>(rows[r].data_ptr<uint8_t>()); };
  bool agree = true;
  for (int p = 0; p < W && agree; ++p) {
    agree = row(p)[0] == row(0)[0] && row(p)[1] == row(0)[1];
    for (int q = 0; q < W && agree; ++q) agree = row(p)[2 + q] == row(q)[2 + W + p];  // p sends to q what q expects
  }
  if (agree) return;
  std::string each;
  for (int r = 0; r < W; ++r) {
    const char* s = reinterpret_cast<const char*>(rows[r].data_ptr<uint8_t>() + headBytes);
    each += c10::str("\n  global rank ", g.global_ranks[r], ": ", std::string(s, strnlen(s, kCallBytes)));
  }
  TORCH_CHECK(false, "dtp: the ranks of a size-", W, " group disagree on collective #", g.collectives + 1,
              " (caught by TORCH_DISTRIBUTED_DEBUG=DETAIL): what one sends is not what another expects.", each,
              "\nEvery rank must pass the same shapes and per-rank sizes. A DTensor built with "
              "from_local(run_check=false) from shards that do not fit one global shape does this: pass "
              "run_check=true or the global shape=.");
}

void install_gloo_abort_hint() {
  static std::once_flag once;
  std::call_once(once, [] {
    static std::terminate_handler previous = std::get_terminate();
    std::set_terminate([] {
      if (auto e = std::current_exception()) {
        try {
          std::rethrow_exception(e);
        } catch (const std::exception& x) {
          if (std::strstr(x.what(), "gloo/transport") != nullptr)
            std::fprintf(stderr,
                         "dtp: Gloo's transport got a message of a size this rank did not expect: the ranks "
                         "disagree on a collective's shapes (for example from_local(run_check=false) with "
                         "shards that do not fit one global shape). Rerun with TORCH_DISTRIBUTED_DEBUG=DETAIL "
                         "to get an error naming the collective and each rank's call.\n");
        } catch (...) {
        }
      }
      if (previous) previous();
      std::abort();
    });
  });
}

}  // namespace dtp
