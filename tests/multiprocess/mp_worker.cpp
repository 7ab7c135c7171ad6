// The rank program of the multi-process tests (see CMakeLists.txt beside it).
// argv[1] picks what it does:
//   collectives  every ProcessGroup collective, on even and uneven sizes
//                (empty shards included), checked against values computed
//                locally; rank 0 prints "collectives ok on W ranks" once
//                every rank agreed
//   mesh         4 ranks: a (dp=2, tp=2) mesh; distribute, redistribute and
//                full_tensor of an uneven f32[5,3]; rank 0 prints "mesh ok"
//   die          rank 1 exits with status 3 right after the rendezvous; the
//                others enter an all_reduce, which must fail (or the launcher
//                stops them), never hang
//   alone        no launcher environment: a world of one without a network
//                listener (two at once must not collide on a port); prints
//                "alone ok"
//   stall        rank 2 sleeps past DTP_TIMEOUT_S instead of joining an
//                all_reduce: the others' errors must name global rank 2
//   chaos        a loop of small all_reduces (the shared-memory path on one
//                host); rank 1 SIGKILLs itself at iteration 300: the others'
//                errors must name global rank 1 (shm_chaos.sh checks that
//                nothing is left in /dev/shm)
//   pipeline_chaos  2 ranks, a 1F1B pipeline of two stages (point-to-point
//                between them); rank 1 SIGKILLs itself inside its stage's
//                forward in the 3rd step: rank 0's error must name global
//                rank 1, never hang
//   rules        2 ranks: both register one lambda rule for aten::tanh and
//                parallelize_module passes ("rules agree ok"); then each
//                registers other strategies for aten::sigmoid and
//                parallelize_module must fail on both, naming the op and
//                each rank's rule (NOTE: [Ranks agree on sharding rules])
//   rules_direct 2 ranks, no set-up API: both register one lambda rule for
//                aten::tanh and call it on a DTensor ("direct rules agree
//                ok"); then each registers other strategies for aten::sigmoid
//                and calls it: its first dispatch must fail on both, naming
//                the op and each rank's rule
//   lonely       init_process_group() and nothing else: started alone with
//                WORLD_SIZE=2, the rendezvous must time out with an error
//                that says what is missing and how to fix it
// Nothing is caught: a dtp error ends the program the way it would end a
// user's program, with its message on stderr and a non-zero status. A value
// mismatch is printed by the rank that saw it and makes every rank exit 1.
#include <dtp/device_mesh.h>
#include <dtp/dtensor.h>
#include <dtp/pp/pipeline.h>
#include <dtp/process_group.h>
#include <dtp/register_sharding.h>
#include <dtp/tp/parallelize.h>
#include <dtp/tp/style.h>

#include <dtp/nn/modules.h>

#include <ATen/ATen.h>

#include <csignal>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

// Compact shape of a tensor: f32[5,3].
std::string shapeStr(const at::Tensor& t) {
  std::ostringstream os;
  os << (t.scalar_type() == at::kFloat ? "f32" : c10::toString(t.scalar_type())) << "[";
  for (int64_t d = 0; d < t.dim(); ++d) os << (d ? "," : "") << t.size(d);
  os << "]";
  return os.str();
}

// Compact text of a small tensor: f32[2,3]{0, 1, 2, 3, 4, 5}.
std::string str(const at::Tensor& t) {
  std::ostringstream os;
  os << shapeStr(t) << "{";
  at::Tensor flat = t.contiguous().view({-1}).to(at::kDouble);
  for (int64_t i = 0; i < flat.numel(); ++i) os << (i ? ", " : "") << flat[i].item<double>();
  os << "}";
  return os.str();
}

// Counts mismatches instead of stopping at the first, so that every rank
// reaches the final all_reduce that decides the verdict for all of them.
class Checker {
 public:
  Checker(std::string what, int rank) : what_(std::move(what)), rank_(rank) {}

  void equal(const std::string& name, const at::Tensor& got, const at::Tensor& expected) {
    if (got.sizes() == expected.sizes() && got.scalar_type() == expected.scalar_type() &&
        at::equal(got, expected)) {
      return;
    }
    fail(name, str(got), str(expected));
  }

  template <typename T>
  void same(const std::string& name, const T& got, const T& expected) {
    if (got == expected) return;
    std::ostringstream g, e;
    g << got;
    e << expected;
    fail(name, g.str(), e.str());
  }

  // Collective over `world`: returns the number of mismatches on all ranks.
  int64_t verdict(const dtp::ProcessGroup& world) const {
    at::Tensor n = at::full({1}, static_cast<double>(failures_), at::kDouble);
    world.all_reduce(n, dtp::ReduceOp::Sum);
    return static_cast<int64_t>(n.item<double>());
  }

 private:
  void fail(const std::string& name, const std::string& got, const std::string& expected) {
    ++failures_;
    std::cerr << what_ << ": mismatch in " << name << " on rank " << rank_ << ": got " << got
              << ", expected " << expected << std::endl;
  }

  std::string what_;
  int rank_;
  int64_t failures_ = 0;
};

std::ostream& operator<<(std::ostream& os, const std::vector<int64_t>& v) {
  return os << c10::IntArrayRef(v);
}
std::ostream& operator<<(std::ostream& os, const std::vector<int>& v) {
  return os << c10::IntArrayRef(std::vector<int64_t>(v.begin(), v.end()));
}

// torch.chunk sizes: 5 rows on 4 ranks -> 2,2,1,0.
std::vector<int64_t> chunkSizes(int64_t n, int64_t ranks) {
  const int64_t chunk = (n + ranks - 1) / ranks;
  std::vector<int64_t> sizes;
  for (int64_t r = 0; r < ranks; ++r) sizes.push_back(std::max<int64_t>(0, std::min(chunk, n - r * chunk)));
  return sizes;
}

int64_t offsetOf(const std::vector<int64_t>& sizes, int64_t r) {
  int64_t off = 0;
  for (int64_t q = 0; q < r; ++q) off += sizes[q];
  return off;
}

// The same tensor on every rank: 0, 1, 2, ... in `shape`.
at::Tensor global(std::vector<int64_t> shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return at::arange(n, at::kFloat).view(shape);
}

// What rank r contributes: small integers (exact in float), with a different
// rank holding the maximum of each element.
at::Tensor rankData(int64_t r, std::vector<int64_t> shape) {
  return at::remainder(global(shape) * 7 + r * 13, 17);
}

// Every rank's contribution stacked along a new dim 0, for local reductions.
at::Tensor allRanks(int64_t world, std::vector<int64_t> shape) {
  std::vector<at::Tensor> all;
  for (int64_t r = 0; r < world; ++r) all.push_back(rankData(r, shape));
  return at::stack(all);
}

int finish(const Checker& check, const dtp::ProcessGroup& world, const std::string& ok_line) {
  const int64_t failures = check.verdict(world);
  if (failures != 0) {
    if (world.rank() == 0) std::cerr << failures << " mismatches on " << world.size() << " ranks\n";
    return 1;
  }
  if (world.rank() == 0) std::cout << ok_line << std::endl;
  return 0;
}

int collectives() {
  dtp::ProcessGroup world = dtp::init_process_group();
  const int me = world.rank();
  const int W = world.size();
  Checker check("collectives", me);

  // all_reduce, every op, on a contiguous and a transposed (non-contiguous) tensor.
  const std::vector<int64_t> shape{3, 5};
  const at::Tensor stacked = allRanks(W, shape);
  const std::pair<dtp::ReduceOp, at::Tensor> reductions[] = {
      {dtp::ReduceOp::Sum, stacked.sum(0)},
      {dtp::ReduceOp::Avg, stacked.sum(0) / W},
      {dtp::ReduceOp::Max, stacked.amax(0)},
      {dtp::ReduceOp::Min, stacked.amin(0)},
  };
  for (const auto& [op, expected] : reductions) {
    at::Tensor t = rankData(me, shape);
    world.all_reduce(t, op);
    check.equal("all_reduce(" + dtp::to_string(op) + ")", t, expected);
  }
  at::Tensor t_nc = rankData(me, {5, 3}).t();
  world.all_reduce(t_nc, dtp::ReduceOp::Sum);
  check.equal("all_reduce(sum) of a transposed tensor", t_nc, allRanks(W, {5, 3}).sum(0).t());
  at::Tensor t_async = rankData(me, shape);
  dtp::Work work = world.all_reduce(t_async, dtp::ReduceOp::Sum, /*async_op=*/true);
  check.equal("async all_reduce(sum)", work.wait(), stacked.sum(0));

  // all_gather: f32[5,3] by rows 2,2,1,0 (on 4 ranks), f32[2,7] by columns
  // 2,2,2,1, and an even f32[8,2] by rows.
  struct Gather {
    std::vector<int64_t> shape;
    int64_t dim;
  };
  for (const Gather& g : {Gather{{5, 3}, 0}, Gather{{2, 7}, 1}, Gather{{4 * W, 2}, 0}}) {
    const at::Tensor full = global(g.shape);
    const auto sizes = chunkSizes(g.shape[g.dim], W);
    at::Tensor local = full.narrow(g.dim, offsetOf(sizes, me), sizes[me]);
    at::Tensor got = world.all_gather(local, g.dim, sizes).wait();
    check.equal("all_gather of " + shapeStr(full) + " along dim " +
                    std::to_string(g.dim) + " by " + c10::str(c10::IntArrayRef(sizes)),
                got, full);
  }

  // reduce_scatter: rows 2,2,1,0 of f32[5,3] summed; columns 2,2,2,1 of
  // f32[3,7] reduced by max; rows of f32[5,3] averaged.
  struct Scatter {
    std::vector<int64_t> shape;
    int64_t dim;
    dtp::ReduceOp op;
  };
  for (const Scatter& s : {Scatter{{5, 3}, 0, dtp::ReduceOp::Sum}, Scatter{{3, 7}, 1, dtp::ReduceOp::Max},
                           Scatter{{5, 3}, 0, dtp::ReduceOp::Avg}}) {
    const auto sizes = chunkSizes(s.shape[s.dim], W);
    const at::Tensor all = allRanks(W, s.shape);
    at::Tensor reduced = s.op == dtp::ReduceOp::Sum   ? all.sum(0)
                         : s.op == dtp::ReduceOp::Max ? all.amax(0)
                                                      : all.sum(0) / W;
    at::Tensor got = world.reduce_scatter(rankData(me, s.shape), s.dim, sizes, s.op).wait();
    check.equal("reduce_scatter(" + dtp::to_string(s.op) + ") along dim " + std::to_string(s.dim) +
                    " by " + c10::str(c10::IntArrayRef(sizes)),
                got, reduced.narrow(s.dim, offsetOf(sizes, me), sizes[me]));
  }

  // broadcast from the last rank (not 0, so a root mix-up shows).
  const int src = W - 1;
  at::Tensor b = me == src ? rankData(src, shape) : at::zeros(shape, at::kFloat);
  world.broadcast(b, src);
  check.equal("broadcast from rank " + std::to_string(src), b, rankData(src, shape));

  // all_to_all as S(1) -> S(0) of f32[5,7]: rank r holds columns 2,2,2,1 and
  // receives rows 2,2,1,0.
  {
    const at::Tensor full = global({5, 7});
    const auto rows = chunkSizes(5, W), cols = chunkSizes(7, W);
    at::Tensor input = full.narrow(1, offsetOf(cols, me), cols[me]);
    at::Tensor got = world.all_to_all(input, /*split_dim=*/0, rows, /*cat_dim=*/1, cols).wait();
    check.equal("all_to_all S(1) -> S(0) of f32[5,7]", got, full.narrow(0, offsetOf(rows, me), rows[me]));
  }

  // scatter from rank 1 (or 0 alone) of chunks with rows 2,2,1,0.
  {
    const int from = W > 1 ? 1 : 0;
    const auto rows = chunkSizes(5, W);
    std::vector<at::Tensor> chunks;
    if (me == from) {
      for (int r = 0; r < W; ++r) chunks.push_back(rankData(r, {rows[r], 3}));
    }
    at::Tensor out = at::empty({rows[me], 3}, at::kFloat);
    world.scatter(out, chunks, from);
    check.equal("scatter from rank " + std::to_string(from), out, rankData(me, {rows[me], 3}));
  }

  world.barrier();
  return finish(check, world, "collectives ok on " + std::to_string(W) + " ranks");
}

int mesh() {
  dtp::ProcessGroup world = dtp::init_process_group();
  TORCH_CHECK(world.size() == 4, "mp_worker mesh: got WORLD_SIZE=", world.size(),
              ", expected 4. Run it with dtprun -n 4.");
  const int me = world.rank();
  Checker check("mesh", me);
  dtp::DeviceMesh mesh = dtp::init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
  if (me == 0) std::cout << mesh << std::endl;

  // Rank r sits at (dp, tp) = (r / 2, r % 2).
  const int64_t dp = me / 2, tp = me % 2;
  check.same("str()", mesh.str(), std::string("DeviceMesh((dp=2, tp=2), cpu)"));
  check.same("get_coordinate()", mesh.get_coordinate(), std::vector<int64_t>{dp, tp});
  check.same("get_local_rank(\"tp\")", mesh.get_local_rank("tp"), tp);
  check.same("mesh[\"tp\"] ranks", mesh["tp"].get_group(0).global_ranks(),
             std::vector<int>{static_cast<int>(2 * dp), static_cast<int>(2 * dp + 1)});
  check.same("get_group(\"dp\") ranks", mesh.get_group("dp").global_ranks(),
             std::vector<int>{static_cast<int>(tp), static_cast<int>(tp + 2)});

  // The sub-groups really talk to each other: the tp group of rank 2 is {2, 3}.
  at::Tensor r = at::full({1}, static_cast<float>(me));
  mesh.get_group("tp").all_reduce(r);
  check.equal("all_reduce over tp", r, at::full({1}, static_cast<float>(4 * dp + 1)));

  // f32[5,3](RS(0)): rows 3,2 on tp. Only rank 0's tensor is read
  // (src_data_rank 0 on both mesh dims), so the others pass junk.
  const at::Tensor full = at::arange(15, at::kFloat).view({5, 3});
  at::Tensor input = me == 0 ? full : at::full({5, 3}, -1.0f - me);
  at::Tensor dt = dtp::distribute_tensor(input, mesh, {dtp::Replicate(), dtp::Shard(0)});
  check.same("spec", dtp::dtensor_spec(dt).str(), std::string("f32[5,3](RS(0))"));
  check.equal("local shard of S(0) on tp", dtp::to_local(dt), full.narrow(0, tp * 3, tp == 0 ? 3 : 2));

  at::Tensor rep = dtp::redistribute(dt, mesh, {dtp::Replicate(), dtp::Replicate()});
  check.same("spec after redistribute", dtp::dtensor_spec(rep).str(), std::string("f32[5,3](RR)"));
  check.equal("redistribute RS(0) -> RR", dtp::to_local(rep), full);
  check.equal("full_tensor of RS(0)", dtp::full_tensor(dt), full);

  // Both mesh dims sharded: f32[5,3](S(0)S(1)), rows 3,2 on dp, columns 2,1 on tp.
  at::Tensor dt2 = dtp::distribute_tensor(full, mesh, {dtp::Shard(0), dtp::Shard(1)});
  check.equal("local shard of S(0)S(1)", dtp::to_local(dt2),
              full.narrow(0, dp * 3, dp == 0 ? 3 : 2).narrow(1, tp * 2, tp == 0 ? 2 : 1));
  check.equal("full_tensor of S(0)S(1)", dtp::full_tensor(dt2), full);

  // P(sum) on dp, S(0) on tp: dp row d holds (d + 1) * its tp shard, so the
  // sum over dp is 3 * full.
  at::Tensor local = full.narrow(0, tp * 3, tp == 0 ? 3 : 2) * static_cast<float>(dp + 1);
  at::Tensor partial = dtp::from_local(local, mesh, {dtp::Partial(), dtp::Shard(0)}, /*run_check=*/false,
                                       std::vector<int64_t>{5, 3});
  check.equal("full_tensor of P(sum)S(0)", dtp::full_tensor(partial), full * 3);

  world.barrier();
  return finish(check, world, "mesh ok");
}

int die() {
  dtp::ProcessGroup world = dtp::init_process_group();
  if (world.rank() == 1) {
    std::cerr << "die: rank 1 exits with status 3 after the rendezvous" << std::endl;
    std::exit(3);
  }
  at::Tensor t = at::ones({4});
  world.all_reduce(t);  // must throw: rank 1 never joins
  std::cerr << "die: all_reduce on rank " << world.rank()
            << " returned although rank 1 exited; expected an error" << std::endl;
  return 1;
}

int stall() {
  dtp::ProcessGroup world = dtp::init_process_group();
  if (world.rank() == 2) {
    std::this_thread::sleep_for(std::chrono::seconds(20));
    return 0;
  }
  at::Tensor t = at::ones({4});
  world.all_reduce(t);  // must throw, naming global rank 2
  std::cerr << "stall: all_reduce returned without rank 2" << std::endl;
  return 1;
}

int chaos() {
  dtp::ProcessGroup world = dtp::init_process_group();
  at::Tensor t = at::ones({256});
  for (int i = 0; i < 1000000; ++i) {
    if (i == 300 && world.rank() == 1) raise(SIGKILL);
    t.fill_(1);
    world.all_reduce(t);  // must throw once rank 1 is gone
    if (t[0].item<float>() != static_cast<float>(world.size())) {
      std::cerr << "chaos: all_reduce gave " << t[0].item<float>() << std::endl;
      return 1;
    }
  }
  std::cerr << "chaos: a million all_reduces returned although rank 1 was killed" << std::endl;
  return 1;
}

int pipelineChaos() {
  dtp::ProcessGroup world = dtp::init_process_group();
  const int rank = world.rank();
  at::Tensor w = at::full({4, 4}, 0.1, at::kDouble).requires_grad_(true);
  int forwards = 0;
  dtp::pp::PipelineStage stage{rank, [&](const at::Tensor& x) {
                                 if (rank == 1 && ++forwards == 2 * 4 + 2) raise(SIGKILL);  // step 3, microbatch 1
                                 return at::matmul(x.to(at::kDouble), w);
                               }, {}};
  dtp::pp::Pipeline pipe(dtp::pp::Schedule::one_f_one_b(2, 4), {stage}, world,
                         [](const at::Tensor& y, const at::Tensor&) { return y.sum(); });
  for (int step = 0; step < 10; ++step) pipe.step(at::ones({8, 4}, at::kDouble), at::ones({8, 4}, at::kDouble));
  std::cerr << "pipeline_chaos: 10 steps returned although rank 1 was killed" << std::endl;
  return 1;
}

int lonely() {
  dtp::init_process_group();  // must throw: the other ranks never arrive
  std::cerr << "lonely: init_process_group returned although no other rank was started; "
               "expected a rendezvous timeout"
            << std::endl;
  return 1;
}

int alone() {
  dtp::ProcessGroup world = dtp::init_process_group();
  Checker check("alone", world.rank());
  check.same("world size", world.size(), 1);
  auto mesh = dtp::init_device_mesh("cpu", {1});
  at::Tensor x = at::arange(6, at::kFloat).view({2, 3});
  check.equal("full_tensor", dtp::full_tensor(dtp::distribute_tensor(x, mesh, {dtp::Shard(0)})), x);
  if (check.verdict(world) > 0) return 1;
  std::this_thread::sleep_for(std::chrono::seconds(1));  // overlap with the other process
  std::cout << "alone ok" << std::endl;
  return 0;
}

int rules() {
  dtp::ProcessGroup world = dtp::init_process_group();
  TORCH_CHECK(world.size() == 2, "mp_worker rules: got WORLD_SIZE=", world.size(), ", expected 2.");
  dtp::DeviceMesh mesh = dtp::init_device_mesh("cpu", {2}, {"tp"});
  // The same lambda on both ranks: the same type in both processes.
  dtp::register_sharding("aten::tanh", [](const dtp::ShardingCall&) {
    return std::vector<dtp::ShardingStrategy>{{{dtp::Replicate()}, {dtp::Replicate()}}};
  }, dtp::RegisterShardingOptions().override_existing(true));
  dtp::nn::Linear a(4, 6);
  dtp::parallelize_module(*a, mesh, dtp::ColwiseParallel());
  if (world.rank() == 0) std::cout << "rules agree ok" << std::endl;
  // Another rule for aten::sigmoid on each rank.
  const dtp::Placement p = world.rank() == 0 ? dtp::Replicate() : dtp::Shard(0);
  dtp::register_sharding("aten::sigmoid", std::vector<dtp::ShardingStrategy>{{{p}, {p}}},
                         dtp::RegisterShardingOptions().override_existing(true));
  dtp::nn::Linear b(4, 6);
  dtp::parallelize_module(*b, mesh, dtp::ColwiseParallel());  // throws on both ranks
  std::cout << "rules that differ were not refused" << std::endl;
  return 0;
}

int rulesDirect() {
  dtp::ProcessGroup world = dtp::init_process_group();
  TORCH_CHECK(world.size() == 2, "mp_worker rules_direct: got WORLD_SIZE=", world.size(), ", expected 2.");
  dtp::DeviceMesh mesh = dtp::init_device_mesh("cpu", {2}, {"tp"});
  dtp::register_sharding("aten::tanh", [](const dtp::ShardingCall&) {
    return std::vector<dtp::ShardingStrategy>{{{dtp::Shard(0)}, {dtp::Shard(0)}}};
  }, dtp::RegisterShardingOptions().override_existing(true));
  const at::Tensor x0 = at::arange(12, at::kDouble).view({4, 3}) / 10;
  const at::Tensor x = dtp::distribute_tensor(x0, mesh, {dtp::Shard(0)});
  Checker check("rules_direct", world.rank());
  check.equal("tanh", dtp::full_tensor(at::tanh(x)), at::tanh(x0));
  if (check.verdict(world) > 0) return 1;
  if (world.rank() == 0) std::cout << "direct rules agree ok" << std::endl;
  // Rank 0 keeps rows whole (R), rank 1 computes on its shard (S(0)): without
  // the check, rank 0 gathers and rank 1 does not, and the values differ.
  const dtp::Placement p = world.rank() == 0 ? dtp::Replicate() : dtp::Shard(0);
  dtp::register_sharding("aten::sigmoid", std::vector<dtp::ShardingStrategy>{{{p}, {p}}},
                         dtp::RegisterShardingOptions().override_existing(true));
  at::sigmoid(x);  // throws on both ranks
  std::cout << "rules that differ were not refused" << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string cmd = argc > 1 ? argv[1] : "";
  if (cmd == "collectives") return collectives();
  if (cmd == "mesh") return mesh();
  if (cmd == "die") return die();
  if (cmd == "lonely") return lonely();
  if (cmd == "alone") return alone();
  if (cmd == "stall") return stall();
  if (cmd == "chaos") return chaos();
  if (cmd == "pipeline_chaos") return pipelineChaos();
  if (cmd == "rules") return rules();
  if (cmd == "rules_direct") return rulesDirect();
  std::cerr << "mp_worker: unknown subcommand '" << cmd
            << "'. Expected collectives, mesh, die, stall, chaos, pipeline_chaos, rules, rules_direct, lonely or alone.\n";
  return 2;
}
