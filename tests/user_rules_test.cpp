// User extensibility (#26): dtp::register_sharding for ops defined in this
// test with TORCH_LIBRARY, and dtp::local_map, against one device in float64
// on meshes (2), (4) and (2,2), with the collectives they cost counted.
#include "close.h"
#include "mesh_test.h"
#include "parity.h"

#include "dtp/comm_counter.h"
#include "dtp/local_map.h"
#include "dtp/register_sharding.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdio>

using namespace dtp;
using dtp::test::data;
using dtp::test::expect_error;
using dtp::test::run_ranks;
using V = std::vector<at::Tensor>;

namespace {

// Each row divided by its root mean square: independent rows.
at::Tensor rmsRows(const at::Tensor& x, double eps) { return x * at::rsqrt(x.pow(2).mean({-1}, true) + eps); }
// The op's CPU kernel: refuses an empty input, which a rank holding an empty
// shard must never hand it (NOTE: [Empty shards run no kernel]).
at::Tensor rmsRowsKernel(const at::Tensor& x, double eps) {
  TORCH_CHECK(x.numel() > 0, "dtptest::rms_rows ran on an empty shard");
  return rmsRows(x, eps);
}
// Each row's sum: a Shard of the summed dim gives partial sums.
at::Tensor rowSums(const at::Tensor& x) { return x.sum(-1); }

}  // namespace

TORCH_LIBRARY(dtptest, m) {
  m.def("rms_rows(Tensor x, float eps) -> Tensor");
  m.def("row_sums(Tensor x) -> Tensor");  // no Meta kernel: needs a shape function
  m.def("no_rule(Tensor x) -> Tensor");   // never given a rule
  m.def("bad_rule(Tensor x) -> Tensor");  // given a malformed rule
  m.def("lying_shape(Tensor x) -> Tensor");  // given a shape function that lies
}
TORCH_LIBRARY_IMPL(dtptest, CPU, m) {
  m.impl("rms_rows", rmsRowsKernel);
  m.impl("row_sums", rowSums);
  m.impl("no_rule", rowSums);
  m.impl("bad_rule", rowSums);
  m.impl("lying_shape", rowSums);
}
TORCH_LIBRARY_IMPL(dtptest, Meta, m) {
  m.impl("rms_rows", rmsRows);
  m.impl("no_rule", rowSums);
  m.impl("bad_rule", rowSums);
}

namespace {

at::Tensor callOp(const char* name, const at::Tensor& x) {
  auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
  if (std::string(name) == "dtptest::rms_rows") return op.template typed<at::Tensor(const at::Tensor&, double)>().call(x, 1e-6);
  return op.template typed<at::Tensor(const at::Tensor&)>().call(x);
}

// Registered once for the whole binary (the registry is global): R, or a
// Shard of any dim but the normalized last one, kept by the output.
void registerRmsRows() {
  static const bool once = [] {
    register_sharding("dtptest::rms_rows", [](const ShardingCall& call) {
      std::vector<ShardingStrategy> s = {{{Replicate()}, {Replicate()}}};
      for (int64_t d = 0; d + 1 < call.input(0).ndim(); ++d) s.push_back({{Shard(d)}, {Shard(d)}});
      return s;
    });
    return true;
  }();
  (void)once;
}

using UserRules = dtp::test::MeshTest;

TEST_P(UserRules, RegisterShardingRunsACustomOpOnShards) {
  registerRmsRows();
  run([&](const DeviceMesh& mesh, int64_t w) {
    at::NoGradGuard no_grad;
    // The first dispatch on a mesh checks the ranks' rule (NOTE: [Ranks agree
    // on sharding rules]): one all_gather per mesh dim, not counted below.
    callOp("dtptest::rms_rows", distribute_tensor(data({w, 6}), mesh, on(mesh, Replicate())));
    for (int64_t rows : {2 * w, 2 * w + 1, w - 1}) {  // even, uneven, an empty shard
      const at::Tensor x = data({rows, 6});
      const at::Tensor ref = rmsRows(x, 1e-6);
      // (placement in, placement out, collectives): S(0) stays; S(1) moves to
      // S(0) (all_to_all, cheaper than gathering to R); P(sum) is
      // reduce-scattered to S(0); R stays R.
      const std::vector<std::tuple<Placement, Placement, int64_t>> cases = {
          {Shard(0), Shard(0), 0}, {Shard(1), Shard(0), 1}, {Partial(), Shard(0), 1}, {Replicate(), Replicate(), 0}};
      for (const auto& [in, out, collectives] : cases) {
        SCOPED_TRACE(in.str() + " rows " + std::to_string(rows));
        at::Tensor dx = in.is_partial() ? from_local(x / static_cast<double>(w), mesh, on(mesh, Partial()), false,
                                                     x.sizes().vec())
                                        : distribute_tensor(x, mesh, on(mesh, in));
        CommCounter comm;
        const at::Tensor y = callOp("dtptest::rms_rows", dx);
        EXPECT_EQ(comm.total_count(), collectives) << comm.str();
        EXPECT_EQ(placements(y), on(mesh, out));
        EXPECT_CLOSE(full_tensor(y), ref, 0.0, 1e-14);
      }
    }
  });
}

TEST_P(UserRules, RegisterShardingTableWithAShapeFunction) {
  static const bool once = [] {
    const std::vector<ShardingStrategy> table = {
        {{Replicate()}, {Replicate()}},
        {{Shard(0)}, {Shard(0)}},     // rows are independent
        {{Shard(-1)}, {Partial()}}};  // a shard of the summed dim sums part of each row
    // No Meta kernel and no shape function: a named error, then a fix.
    register_sharding("dtptest::row_sums", table);
    return true;
  }();
  (void)once;
  run([&](const DeviceMesh& mesh, int64_t w) {
    at::NoGradGuard no_grad;
    const at::Tensor x = data({2 * w + 1, 2 * w + 3});
    const at::Tensor dx = distribute_tensor(x, mesh, on(mesh, Shard(1)));
    static std::once_flag fix;
    std::call_once(fix, [&] {
      expect_error([&] { callOp("dtptest::row_sums", dx); },
                   {"cannot infer the output shape of dtptest::row_sums", "Register a Meta kernel",
                    "RegisterShardingOptions::shape"});
      expect_error([&] { register_sharding("dtptest::row_sums", std::vector<ShardingStrategy>{}); },
                   {"dtptest::row_sums already has a sharding rule", "override_existing(true)"});
      register_sharding("dtptest::row_sums",
                        std::vector<ShardingStrategy>{{{Replicate()}, {Replicate()}},
                                                      {{Shard(0)}, {Shard(0)}},
                                                      {{Shard(-1)}, {Partial()}}},
                        RegisterShardingOptions().override_existing(true).shape([](const ShardingCall& call) {
                          const auto& in = call.input(0);
                          return OutputShapes{{{in.shape[0]}}, {in.dtype}};
                        }));
    });
    callOp("dtptest::row_sums", dx);  // the first dispatch's rule check, not counted below
    for (auto in : {Shard(0), Shard(1), Replicate()}) {
      SCOPED_TRACE(in.str());
      const at::Tensor d = distribute_tensor(x, mesh, on(mesh, in));
      CommCounter comm;
      const at::Tensor y = callOp("dtptest::row_sums", d);
      EXPECT_EQ(comm.total_count(), 0) << comm.str();
      EXPECT_EQ(placements(y), on(mesh, in.is_shard(1) ? Partial() : in));
      EXPECT_CLOSE(full_tensor(y), rowSums(x), 0.0, 1e-14);
    }
  });
}

TEST(UserRulesErrors, BadRegistrationsAndCallsAreNamedErrors) {
  expect_error([] { register_sharding("aten::mm", std::vector<ShardingStrategy>{}); },
               {"aten::mm already has a sharding rule", "override_existing(true)"});
  expect_error([] { register_sharding("dtptest::nope", std::vector<ShardingStrategy>{}); },
               {"no op 'dtptest::nope' is registered", "TORCH_LIBRARY"});
  expect_error([] { register_sharding("aten::linear", std::vector<ShardingStrategy>{}); },
               {"aten::linear is CompositeImplicitAutograd", "would never run"});
  static const bool once = [] {
    register_sharding("dtptest::bad_rule.default",
                      std::vector<ShardingStrategy>{{{Replicate(), Replicate()}, {Replicate()}}, {{Shard(3)}, {Shard(0)}}});
    // Two rows too many: the output the op computes is not the rule's.
    register_sharding("dtptest::lying_shape", std::vector<ShardingStrategy>{{{Shard(0)}, {Shard(0)}}},
                      RegisterShardingOptions().shape([](const ShardingCall& call) {
                        return OutputShapes{{{call.input(0).shape[0] + 2}}, {call.input(0).dtype}};
                      }));
    return true;
  }();
  (void)once;
  run_ranks(2, [](int) {
    at::NoGradGuard no_grad;
    const auto mesh = init_device_mesh("cpu", {2});
    const at::Tensor x = distribute_tensor(data({4, 3}), mesh, {Shard(0)});
    expect_error([&] { callOp("dtptest::no_rule", x); }, {"no sharding rule for dtptest::no_rule", "f64[4,3](S(0))"});
    expect_error([&] { callOp("dtptest::bad_rule", x); },
                 {"the rule for dtptest::bad_rule returned strategy 0 with 2 input and 1 output placements",
                  "the call has 1 DTensor inputs and 1 tensor outputs"});
    expect_error([&] { callOp("dtptest::lying_shape", x); },
                 {"dtp: dtptest::lying_shape computed a local output of [2] here, but sharding propagation says "
                  "f64[6](S(0)), whose local shard here is [3]", "your rule's output shapes", "fix the rule"});
  });
}

// A function of local tensors: the rows of x through a replicated weight. The
// gradient of w computed on one rank's rows is that rank's part of the sum
// over all rows: P(sum), which in_grad_placements says.
V rowsThroughWeight(const V& in) { return {at::tanh(at::matmul(in[0], in[1])) * 2}; }

TEST_P(UserRules, LocalMapIsDifferentiableAndHonoursInGradPlacements) {
  run([&](const DeviceMesh& mesh, int64_t w) {
    for (int64_t rows : {2 * w, 2 * w + 1}) {
      SCOPED_TRACE("rows " + std::to_string(rows));
      const at::Tensor x0 = data({rows, 5}), w0 = data({5, 3}, 0.4);
      at::Tensor x = x0.clone().requires_grad_(), wt = w0.clone().requires_grad_();
      const at::Tensor g = data({rows, 3}, 0.9);
      (rowsThroughWeight({x, wt})[0] * g).sum().backward();

      at::Tensor dx = distribute_tensor(x0.clone().requires_grad_(), mesh, on(mesh, Shard(0)));
      at::Tensor dw = distribute_tensor(w0.clone().requires_grad_(), mesh, on(mesh, Replicate()));
      const auto f = local_map(rowsThroughWeight, {on(mesh, Shard(0))}, {on(mesh, Shard(0)), on(mesh, Replicate())},
                               {on(mesh, Shard(0)), on(mesh, Partial())},
                               LocalMapOptions().out_shapes({std::vector<int64_t>{rows, 3}}));
      CommCounter comm;
      const at::Tensor y = f({dx, dw})[0];
      EXPECT_EQ(comm.total_count(), 0) << "the forward runs on shards: " << comm.str();
      EXPECT_EQ(placements(y), on(mesh, Shard(0)));
      EXPECT_CLOSE(full_tensor(y), rowsThroughWeight({x0, w0})[0], 0.0, 1e-14);
      (full_tensor(y) * g).sum().backward();
      EXPECT_EQ(placements(dx.grad()), on(mesh, Shard(0)));
      EXPECT_CLOSE(full_tensor(dx.grad()), x.grad(), 0.0, 1e-14);
      EXPECT_EQ(placements(dw.grad()), on(mesh, Replicate()));
      EXPECT_CLOSE(full_tensor(dw.grad()), wt.grad(), 0.0, 1e-13);
    }
  });
}

TEST_P(UserRules, LocalMapChecksAndRedistributesInputs) {
  run([&](const DeviceMesh& mesh, int64_t w) {
    at::NoGradGuard no_grad;
    const at::Tensor x0 = data({2 * w, 5});
    const at::Tensor x = distribute_tensor(x0, mesh, on(mesh, Shard(1)));
    const auto rowNorms = [](const V& in) { return V{in[0].norm(2, {-1}, true)}; };
    const std::vector<std::optional<Placements>> out{on(mesh, Shard(0))}, in{on(mesh, Shard(0))};
    expect_error([&] { local_map(rowNorms, out, in)({x}); },
                 {"input 0 is f64[" + std::to_string(2 * w) + ",5](", "but in_placements[0] is",
                  "redistribute_inputs(true)"});
    expect_error([&] { local_map(rowNorms, {}, in, {}, LocalMapOptions().redistribute_inputs(true))({x}); },
                 {"the function returned 1 tensors, but out_placements has 0"});
    CommCounter comm;
    const at::Tensor y = local_map(rowNorms, out, in, {}, LocalMapOptions().redistribute_inputs(true))({x})[0];
    EXPECT_EQ(comm.count(CollectiveType::AllToAll), 1) << "one all_to_all, S(1) to S(0): " << comm.str();
    // NOTE: [Uneven local_map outputs]: the first call checks the S(0)
    // output's shards are even (no out_shapes): one all_gather over the
    // mesh dim that shards it.
    EXPECT_EQ(comm.count(CollectiveType::AllGather), 1) << comm.str();
    EXPECT_EQ(comm.total_count(), 2) << comm.str();
    EXPECT_CLOSE(full_tensor(y), x0.norm(2, {-1}, true), 0.0, 1e-14);
    // Without DTensor inputs the function runs as it is.
    EXPECT_FALSE(is_dtensor(local_map(rowNorms, out, in)({x0})[0]));
  });
}

// supported_ops() lists dtp's rules and handlers and the users' rules.
TEST(UserRulesErrors, SupportedOpsListsUserRules) {
  registerRmsRows();
  const auto ops = supported_ops();
  const auto own = std::count_if(ops.begin(), ops.end(), [](const std::string& op) { return op.rfind("dtptest::", 0) != 0; });
  std::printf("supported_ops(): %td overloads with dtp's own rules or handlers\n", own);
  EXPECT_EQ(std::count(ops.begin(), ops.end(), "dtptest::rms_rows"), 1);
  for (const char* op : {"aten::convolution", "aten::convolution_backward", "aten::index_select", "aten::mm"})
    EXPECT_EQ(std::count(ops.begin(), ops.end(), op), 1) << op;
}

INSTANTIATE_TEST_SUITE_P(Meshes, UserRules, dtp::test::mesh_shapes(), dtp::test::mesh_name);

}  // namespace
