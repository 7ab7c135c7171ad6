#include "step_plan.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>

namespace dtp::inference {
namespace {

constexpr int64_t kBlock = 512;  // integers of a plan's first broadcast

int64_t bitsOf(double d) {
  int64_t i;
  std::memcpy(&i, &d, sizeof(i));
  return i;
}

double doubleOf(int64_t i) {
  double d;
  std::memcpy(&d, &i, sizeof(d));
  return d;
}

}  // namespace

std::vector<int64_t> encode_plan(const StepPlan& p) {
  std::vector<int64_t> d = {p.op};
  auto list = [&](const std::vector<int64_t>& v) {
    d.push_back(static_cast<int64_t>(v.size()));
    d.insert(d.end(), v.begin(), v.end());
  };
  list(p.keep);
  list(p.preempt);
  list(p.forget);
  list(p.tokens);
  list(p.chunks);
  d.push_back(static_cast<int64_t>(p.admit.size()));
  for (const Admission& a : p.admit) {
    d.insert(d.end(), {a.id, static_cast<int64_t>(a.sampling.seed), bitsOf(a.sampling.options.temperature),
                       a.sampling.options.top_k, bitsOf(a.sampling.options.top_p), a.resume ? 1 : 0, a.logprobs, a.cached});
    list(a.prompt);
  }
  return d;
}

StepPlan decode_plan(const std::vector<int64_t>& d) {
  StepPlan p;
  size_t i = 0;
  auto next = [&]() {
    TORCH_CHECK(i < d.size(), "dtp::inference: a step plan of ", d.size(), " integers ends early: got a truncated plan, "
                "expected a whole one. Ranks must run the same dtp build.");
    return d[i++];
  };
  auto list = [&](std::vector<int64_t>& v) {
    const int64_t n = next();
    for (int64_t k = 0; k < n; ++k) v.push_back(next());
  };
  p.op = next();
  list(p.keep);
  list(p.preempt);
  list(p.forget);
  list(p.tokens);
  list(p.chunks);
  const int64_t admit = next();
  for (int64_t k = 0; k < admit; ++k) {
    Admission a;
    a.id = next();
    a.sampling.seed = static_cast<uint64_t>(next());
    a.sampling.options.temperature = doubleOf(next());
    a.sampling.options.top_k = next();
    a.sampling.options.top_p = doubleOf(next());
    a.resume = next() != 0;
    a.logprobs = next();
    a.cached = next();
    list(a.prompt);
    p.admit.push_back(std::move(a));
  }
  return p;
}

StepPlan broadcast_plan(const std::optional<ProcessGroup>& group, const StepPlan& plan) {
  if (!group || group->size() == 1) return plan;
  std::vector<int64_t> data;
  if (group->rank() == 0) data = encode_plan(plan);
  // [length, first kBlock - 1 integers]; the rest, if any, in a second broadcast.
  at::Tensor head = at::zeros({kBlock}, at::kLong);
  if (group->rank() == 0) {
    head[0] = static_cast<int64_t>(data.size());
    const int64_t n = std::min<int64_t>(data.size(), kBlock - 1);
    std::copy(data.begin(), data.begin() + n, head.data_ptr<int64_t>() + 1);
  }
  group->broadcast(head, /*src=*/0);
  const int64_t total = head[0].item<int64_t>();
  if (group->rank() != 0) {
    const int64_t n = std::min<int64_t>(total, kBlock - 1);
    data.assign(head.data_ptr<int64_t>() + 1, head.data_ptr<int64_t>() + 1 + n);
  }
  if (total > kBlock - 1) {
    at::Tensor rest = group->rank() == 0 ? at::tensor(std::vector<int64_t>(data.begin() + (kBlock - 1), data.end()), at::kLong)
                                         : at::zeros({total - (kBlock - 1)}, at::kLong);
    group->broadcast(rest, /*src=*/0);
    if (group->rank() != 0) data.insert(data.end(), rest.data_ptr<int64_t>(), rest.data_ptr<int64_t>() + rest.numel());
  }
  return group->rank() == 0 ? plan : decode_plan(data);
}

}  // namespace dtp::inference
