#include "comm/agree.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>

namespace dtp {

namespace {
thread_local const CollectiveCaller* current_caller = nullptr;
}  // namespace

CollectiveCaller::CollectiveCaller(const std::string& api, std::string must)
    : api_(api),
      must_(must.empty() ? "every rank of the group must call " + api + ", with the same arguments" : std::move(must)),
      prev_(current_caller) {
  current_caller = this;
}

CollectiveCaller::~CollectiveCaller() { current_caller = prev_; }

const CollectiveCaller* CollectiveCaller::current() { return current_caller; }

std::vector<std::string> all_gather_strings(const std::optional<ProcessGroup>& group, const std::string& mine) {
  if (!group || group->size() == 1) return {mine};
  const int64_t w = group->size();
  at::Tensor len = at::full({1}, static_cast<int64_t>(mine.size()), at::kLong);
  at::Tensor lens = group->all_gather(len, 0, std::vector<int64_t>(w, 1)).wait();
  std::vector<int64_t> sizes(lens.data_ptr<int64_t>(), lens.data_ptr<int64_t>() + w);
  at::Tensor bytes = at::empty({static_cast<int64_t>(mine.size())}, at::kByte);
  if (!mine.empty()) std::memcpy(bytes.data_ptr(), mine.data(), mine.size());
  at::Tensor all = group->all_gather(bytes, 0, sizes).wait().contiguous();
  std::vector<std::string> out;
  const char* p = static_cast<const char*>(all.data_ptr());
  for (int64_t r = 0; r < w; ++r) {
    out.emplace_back(p, static_cast<size_t>(sizes[r]));
    p += sizes[r];
  }
  return out;
}

void agree_on_value(const std::optional<ProcessGroup>& group, const std::string& api, const std::string& argument,
                    const std::string& value) {
  std::vector<std::string> values;
  {
    const CollectiveCaller caller(api);  // NOTE: [A collective API names its first collective]
    values = all_gather_strings(group, value);
  }
  // Long values are shown around where the first of them departs from rank 0's.
  size_t at = 0;
  bool same = true;
  for (const auto& v : values) {
    if (v == values[0]) continue;
    same = false;
    const auto [a, b] = std::mismatch(v.begin(), v.end(), values[0].begin(), values[0].end());
    at = std::max(at, static_cast<size_t>(a - v.begin()));
  }
  if (same) return;
  const size_t from = at > 60 ? at - 60 : 0;
  std::string each;
  for (size_t r = 0; r < values.size(); ++r) {
    const std::string& v = values[r];
    const std::string shown = v.size() <= 120 ? v : (from > 0 ? "..." : "") + v.substr(from, 120) +
                                                        (from + 120 < v.size() ? "..." : "");
    each += "\n  rank " + std::to_string(r) + ": '" + shown + "'" +
            (v.size() > 120 ? " (" + std::to_string(v.size()) + " bytes)" : "");
  }
  TORCH_CHECK(false, api, ": the ranks passed different ", argument, " (every rank must pass the same):", each);
}

}  // namespace dtp
