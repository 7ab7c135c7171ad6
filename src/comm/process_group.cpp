#include "dtp/process_group.h"

#include "comm/collective_check.h"
#include "comm/collective_tape.h"
#include "comm/local_device.h"
#include "comm/error_text.h"
#include "comm/gloo.h"
#include "comm/trace_span.h"
#include "comm/two_level.h"
#include "dtp/comm_counter.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#ifdef DTP_WITH_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <iostream>
#include <mutex>
#include <numeric>
#include <thread>
#include <sstream>

// NOTE: [Uneven shards]
// Shards follow torch.chunk: f32[5,10](S(0)) on 4 ranks has local rows 2,2,1,0.
// Gloo's all_gather wants equal sizes, so all_gather pads every rank's flattened
// shard to the largest one and narrows afterwards. reduce_scatter, all_to_all
// and scatter go through all_to_all with per-rank counts, which moves exactly
// the bytes needed and no padding. Every collective here takes the per-rank
// sizes explicitly; callers derive them from the global shape, never from the
// local tensor alone, so an empty shard is as valid as any other.

namespace dtp {

namespace {

thread_local ProcessGroup default_group;

int64_t nbytes(const at::Tensor& t) { return t.numel() * t.element_size(); }

// Gloo has no bool type, and libtorch 1.13's Gloo no bfloat16: such tensors
// travel as their bytes (bool: one byte, 0 or 1; bfloat16: two), which every
// collective that only moves data keeps valid. all_reduce sums bfloat16 in
// float32 and rounds once.
at::Tensor wire(const at::Tensor& t) {
  if (t.scalar_type() == at::kBool) return t.view(at::kByte);
  if (t.scalar_type() == at::kBFloat16) return t.view(at::kHalf);  // 2 bytes Gloo only copies
  return t;
}

c10d::ReduceOp toC10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg:  // Gloo has no AVG: sum, then divide.
      return c10d::ReduceOp::SUM;
    case ReduceOp::Max: return c10d::ReduceOp::MAX;
    case ReduceOp::Min: return c10d::ReduceOp::MIN;
  }
  return c10d::ReduceOp::SUM;
}

// NOTE: [Backends per device] Every group has Gloo for CPU tensors and, when
// asked ("nccl") or available ("auto": dtp built with NCCL and a CUDA device
// present), NCCL for CUDA tensors: PyTorch's "cpu:gloo,cuda:nccl". Each
// collective goes to the backend of its tensor's device; NCCL never sees a
// CPU tensor. The NCCL communicator is set up by NCCL on first use.
bool wantsNccl(const std::string& requested) {
  if (requested == "gloo") return false;
  if (requested == "nccl") {
#ifdef DTP_WITH_NCCL
    return true;
#else
    TORCH_CHECK(false, "dtp: backend 'nccl' requested, but dtp was built without NCCL. "
                       "Rebuild with -DDTP_WITH_NCCL=ON against a CUDA libtorch, or use 'gloo'.");
#endif
  }
  TORCH_CHECK(requested == "auto", "dtp: unknown backend '", requested,
              "', expected 'gloo', 'nccl' or 'auto'.");
#ifdef DTP_WITH_NCCL
  return at::hasCUDA();
#else
  return false;
#endif
}

// NOTE: [A dead peer is an error, not SIGPIPE] A rank that writes to the
// socket of a peer that died gets SIGPIPE, whose default action ends the
// process silently (exit status 141) where dtp would name the peer that did
// not arrive. Some Gloo releases (the torch 2.11 wheel's) write without
// MSG_NOSIGNAL; Python ignores SIGPIPE at start-up, so PyTorch never sees it.
// dtp ignores it as well when the program left it at its default: the write
// then fails with EPIPE and the collective's error says who died.
void ignoreSigpipe() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction current {};
    if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) ::signal(SIGPIPE, SIG_IGN);
  });
}

// Gloo (and NCCL when wanted) for group `g`, meeting under its store prefix.
void connect(ProcessGroup::Impl& g, bool nccl) {
  auto store = c10::make_intrusive<c10d::PrefixStore>(g.prefix, g.root_store);
  auto opts = c10d::ProcessGroupGloo::Options::create(g.options.timeout);
  // One Gloo device per address of a comma-separated list (GLOO_SOCKET_IFNAME
  // with several interfaces); "*" as c10d's default. See NOTE: [Choosing the
  // interface] in bind_address.cpp.
  const std::string addrs = g.options.bind_address.empty() ? "127.0.0.1" : g.options.bind_address;
  for (size_t start = 0; start < addrs.size();) {
    const size_t comma = std::min(addrs.find(',', start), addrs.size());
    const std::string addr = addrs.substr(start, comma - start);
    start = comma + 1;
    if (addr.empty()) continue;
    opts->devices.push_back(addr == "*" ? c10d::ProcessGroupGloo::createDefaultDevice()
                                        : c10d::ProcessGroupGloo::createDeviceForHostname(addr));
  }
  TORCH_CHECK(!opts->devices.empty(), "dtp: process group: bind_address '", addrs,
              "': got no address, expected an address or a comma-separated list. Fix ProcessGroupOptions::bind_address "
              "or DTP_BIND_ADDR.");
  opts->threads = 1;
  g.backend = c10::make_intrusive<c10d::ProcessGroupGloo>(store, g.rank, g.size, opts);
  if (g.size > 1) g.shm = detail::ShmGroup::connect(store, g.rank, g.size, g.options.timeout);  // NOTE: [Shared-memory collectives]
  if (g.size > 1 && !g.shm)  // on several hosts: NOTE: [Two-level collectives]
    g.two_level = detail::TwoLevel::connect(store, g.rank, g.size, opts, g.options.timeout);
  if (g.two_level && g.rank == 0 && detail::two_level_announced()) {
    std::vector<int> leaders;
    for (int r : g.two_level->leaders()) leaders.push_back(g.global_ranks[r]);
    std::cerr << "dtp: two-level collectives for global ranks " << c10::ArrayRef<int>(g.global_ranks) << " over "
              << g.two_level->hosts() << " hosts (leaders: global ranks " << c10::ArrayRef<int>(leaders) << ")\n";
  }
#ifdef DTP_WITH_NCCL
  if (nccl) {
    auto nccl_opts = c10d::ProcessGroupNCCL::Options::create();
    nccl_opts->timeout = g.options.timeout;
    g.cuda_backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(
        c10::make_intrusive<c10d::PrefixStore>("nccl", store), g.rank, g.size, nccl_opts);
  }
#else
  (void)nccl;
#endif
}

std::vector<int64_t> chunkShape(const at::Tensor& like, int64_t dim, int64_t size_at_dim) {
  auto shape = like.sizes().vec();
  shape[dim] = size_at_dim;
  return shape;
}

int64_t numelOf(const std::vector<int64_t>& shape) {
  return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
}

// "f64[2, 4]" and "[2, 2]", for the call descriptions of NOTE: [Collective checks].
std::string shapeText(const at::Tensor& t) {
  return c10::str(c10::toString(t.scalar_type()), t.sizes());
}
std::string listText(const std::vector<int64_t>& v) { return c10::str(c10::IntArrayRef(v)); }

// Counts a collective (CommCounter) and names it for profilers until the
// caller returns (NOTE: [Trace spans]).
detail::TraceSpan counted(CollectiveType type, int64_t bytes, const std::vector<int>& ranks) {
  CommCounter::record(type, bytes, ranks);
  return detail::TraceSpan([&] { return c10::str(to_string(type), " ", bytes, " B over ranks ", c10::ArrayRef<int>(ranks)); });
}

}  // namespace

// See NOTE: [Backends per device].
compat::Backend& backend_for(const ProcessGroup::Impl& g, const at::Tensor& t) {
  if (!t.is_cuda()) return *g.backend;
  TORCH_CHECK(g.cuda_backend, "dtp: a CUDA tensor in a collective of a group without a CUDA backend (",
              g.backend_name, "): dtp was built without NCCL, or the group was made with backend \"gloo\". "
              "Rebuild with -DDTP_WITH_NCCL=ON against a CUDA libtorch, or keep the tensors on the CPU.");
  return *g.cuda_backend;
}

std::mutex& gloo_issue_mutex() {
  static std::mutex m;
  return m;
}

std::string to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Avg: return "avg";
    case ReduceOp::Max: return "max";
    case ReduceOp::Min: return "min";
  }
  return "?";
}

Work Work::ready(at::Tensor result) {
  return Work([r = std::move(result)] { return r; });
}

at::Tensor Work::wait() {
  if (!done_) {
    TORCH_CHECK(wait_fn_, "dtp: wait() on an empty Work handle.");
    result_ = wait_fn_();
    wait_fn_ = nullptr;
    done_ = true;
  }
  return result_;
}

ProcessGroup ProcessGroup::create(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                  int size, const ProcessGroupOptions& options) {
  TORCH_CHECK(size >= 1 && rank >= 0 && rank < size,
              "dtp: invalid rank ", rank, " for a group of size ", size,
              ". Expected 0 <= rank < size.");
  auto impl = std::make_shared<Impl>();
  impl->root_store = store;
  impl->prefix = "dtp";
  impl->rank = rank;
  impl->size = size;
  impl->global_ranks.resize(size);
  std::iota(impl->global_ranks.begin(), impl->global_ranks.end(), 0);
  impl->options = options;
  const char* debug = std::getenv("TORCH_DISTRIBUTED_DEBUG");
  if (debug != nullptr && std::string(debug) == "DETAIL") impl->options.check_collectives = true;
  impl->nccl = wantsNccl(options.backend);
  impl->backend_name = impl->nccl ? "cpu:gloo,cuda:nccl" : "gloo";
  // NOTE: [The rank's device]. Asked for NCCL by name, the group takes its GPU
  // now; with "auto" a job on CPU tensors may run more ranks than the host has
  // GPUs (init_device_mesh("cuda") takes and checks the GPU).
  if (impl->nccl && options.backend == "nccl") detail::rank_device("cuda", rank, "dtp: process group");
  install_gloo_abort_hint();
  ignoreSigpipe();
  detail::shm_max_bytes();  // a malformed DTP_SHM_MAX_BYTES is named here, not as a failure to connect
  detail::two_level_enabled();  // and DTP_TWO_LEVEL
  try {
    connect(*impl, impl->nccl);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "dtp: rank ", rank, " could not connect to the other ", size - 1,
                " ranks of the world group (timeout ", options.timeout.count() / 1000,
                " s): ", error_text(e),
                "\nCheck that all WORLD_SIZE ranks were started with the same "
                "MASTER_ADDR/MASTER_PORT.");
  }
  return ProcessGroup(std::move(impl));
}

ProcessGroup::Impl& ProcessGroup::impl() const {
  TORCH_CHECK(impl_ != nullptr, "ProcessGroup: this handle is invalid (default-constructed, or from new_group on a "
              "rank outside the group). Get one from init_process_group(), default_process_group() or "
              "DeviceMesh::get_group().");
  return *impl_;
}

int ProcessGroup::rank() const { return impl().rank; }
int ProcessGroup::size() const { return impl().size; }
const std::vector<int>& ProcessGroup::global_ranks() const { return impl().global_ranks; }
const std::string& ProcessGroup::backend_name() const { return impl().backend_name; }

std::string ProcessGroup::str() const {
  if (!impl_) return "ProcessGroup(invalid)";
  std::ostringstream os;
  os << "ProcessGroup(" << impl_->backend_name << ", rank " << impl_->rank << " of "
     << impl_->size << ", ranks [";
  for (size_t i = 0; i < impl_->global_ranks.size(); ++i)
    os << (i ? "," : "") << impl_->global_ranks[i];
  os << "])";
  return os.str();
}

ProcessGroup ProcessGroup::new_group(const std::vector<int>& ranks) const {
  Impl& self = impl();
  std::vector<int> sorted = ranks;
  std::sort(sorted.begin(), sorted.end());
  TORCH_CHECK(!ranks.empty() && std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end() &&
                  sorted.front() >= 0 && sorted.back() < self.size,
              "dtp: new_group got invalid ranks for a group of size ", self.size,
              ": expected distinct ranks in [0, ", self.size, ").");
  const int64_t id = self.next_group_id++;
  auto it = std::find(ranks.begin(), ranks.end(), self.rank);
  if (it == ranks.end()) return ProcessGroup();

  auto impl = std::make_shared<Impl>();
  impl->root_store = self.root_store;
  impl->prefix = self.prefix + "/" + std::to_string(id);
  impl->rank = static_cast<int>(it - ranks.begin());
  impl->size = static_cast<int>(ranks.size());
  for (int r : ranks) impl->global_ranks.push_back(self.global_ranks[r]);
  impl->options = self.options;
  impl->backend_name = self.backend_name;
  impl->nccl = self.nccl;
  if (impl->size > 1) {
    try {
      connect(*impl, impl->nccl);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "dtp: could not create a sub-group of ranks ",
                  c10::IntArrayRef(std::vector<int64_t>(impl->global_ranks.begin(),
                                                        impl->global_ranks.end())),
                  ": ", error_text(e),
                  "\nEvery rank of the parent group must call new_group in the same order.");
    }
  }
  return ProcessGroup(std::move(impl));
}

namespace {

// Waits for a c10d work and turns a peer failure into one readable line that
// names the collective, the group, the ranks that did not arrive and why.
Work finish(const std::shared_ptr<ProcessGroup::Impl>& group, const char* what,
            c10::intrusive_ptr<c10d::Work> work, std::function<at::Tensor()> then,
            bool async_op) {
  const int64_t n = ++group->collectives;
  // Holds the group: an async Work may outlive the caller's handle.
  Work result([group, n, what, work = std::move(work), then = std::move(then)] {
    try {
      work->wait();
    } catch (const std::exception& e) {
      explain_failure(*group, what, n, e);
    }
    return then();
  });
  if (!async_op) result.wait();
  return result;
}

// The shared-memory path for a collective on `t` that puts `bytes` into each
// rank's slot: CPU tensors up to the slot size on groups whose ranks share a
// host (NOTE: [Shared-memory collectives]); every member decides alike, from
// shapes every member knows. Gloo (or NCCL) carries the rest.
detail::ShmGroup* shmFor(const ProcessGroup::Impl& g, const at::Tensor& t, int64_t bytes) {
  return g.shm && !t.is_cuda() && bytes <= g.shm->max_bytes() ? g.shm.get() : nullptr;
}

// The two-level path for a group on several hosts, under the same rule
// (NOTE: [Two-level collectives]).
detail::TwoLevel* twoLevelFor(const ProcessGroup::Impl& g, const at::Tensor& t, int64_t bytes) {
  return g.two_level && !t.is_cuda() && bytes <= g.two_level->max_bytes() ? g.two_level.get() : nullptr;
}

// Runs a shared-memory or two-level collective now (both paths are
// synchronous), counted and failing like `finish`.
Work viaShm(const std::shared_ptr<ProcessGroup::Impl>& group, const char* what, const std::function<at::Tensor()>& run) {
  const int64_t n = ++group->collectives;
  try {
    return Work::ready(run());
  } catch (const std::exception& e) {
    explain_failure(*group, what, n, e);
  }
}

// Half and bfloat16 are reduced in float32 on the shared-memory path and rounded once.
bool widened(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf; }

void checkSizes(const ProcessGroup::Impl& g, const char* what,
                const std::vector<int64_t>& sizes) {
  TORCH_CHECK(static_cast<int>(sizes.size()) == g.size, "dtp: ", what, " got ",
              sizes.size(), " per-rank sizes for a group of ", g.size,
              " ranks. Pass one size per rank.");
}

}  // namespace

namespace {

// NOTE: [Collective tape]: while recording, `run` (the collective itself)
// completes and a copy of its result is kept; while replaying, the kept
// result stands in (copied into the in-place target, if any).
Work taped(detail::CollectiveTape& tape, const std::function<Work()>& run, const at::Tensor* in_place) {
  if (tape.replaying()) {
    const at::Tensor& kept = tape.pop();
    if (in_place == nullptr) return Work::ready(kept);
    at::Tensor target = *in_place;
    target.copy_(kept);
    return Work::ready(target);
  }
  at::Tensor result;
  {
    detail::TapeBypass bypass;
    result = run().wait();
  }
  tape.push(result.defined() ? result.clone() : result);
  return Work::ready(result);
}

}  // namespace

// NOTE: [Zero-size collectives]
// Gloo divides by the element count and dies of SIGFPE on empty buffers. A
// collective whose buffers are empty on every rank moves nothing, so it is
// skipped (and not counted). Each rank can tell: the shapes that make it
// empty (the tensor's, or the per-rank sizes passed) are the same everywhere.

Work ProcessGroup::all_reduce(at::Tensor tensor, ReduceOp op, bool async_op) const {
  if (auto* tape = detail::active_tape()) return taped(*tape, [&] { return all_reduce(tensor, op); }, &tensor);
  if (impl().size == 1) return Work::ready(tensor);
  check_collective(impl(), {"all_reduce", c10::str("all_reduce(", to_string(op), ") of ", shapeText(tensor)),
                            tensor.scalar_type(), std::vector<int64_t>(impl().size, tensor.numel()),
                            std::vector<int64_t>(impl().size, tensor.numel())});
  if (tensor.numel() == 0) return Work::ready(tensor);
  TORCH_CHECK(tensor.scalar_type() != at::kBool || op == ReduceOp::Max || op == ReduceOp::Min,
              "dtp: all_reduce(", to_string(op), ") of a bool tensor is not defined. Use ReduceOp::Max "
              "(logical or) or ReduceOp::Min (logical and), or convert to an integer type first.");
  const detail::TraceSpan span = counted(CollectiveType::AllReduce, nbytes(tensor), impl().global_ranks);
  auto local = [&](auto* path) {
    return viaShm(impl_, "all_reduce", [&] {
      at::Tensor buf = widened(tensor) ? tensor.to(at::kFloat) : tensor.contiguous();
      at::Tensor flat = wire(buf).view({-1});
      path->all_reduce(flat, op);
      if (!buf.is_same(tensor)) tensor.copy_(buf);
      return tensor;
    });
  };
  const int64_t slot_bytes = tensor.numel() * (widened(tensor) ? 4 : tensor.element_size());
  if (auto* shm = shmFor(impl(), tensor, slot_bytes)) return local(shm);
  if (auto* two_level = twoLevelFor(impl(), tensor, slot_bytes)) return local(two_level);
  at::Tensor buf = tensor.scalar_type() == at::kBFloat16 ? tensor.to(at::kFloat)
                   : tensor.is_contiguous()              ? tensor
                                                         : tensor.contiguous();
  std::vector<at::Tensor> bufs{wire(buf)};
  c10d::AllreduceOptions opts;
  opts.reduceOp = toC10d(op);
  auto work = issue(impl(), buf, [&](compat::Backend& b) { return b.allreduce(bufs, opts); });
  const int size = impl().size;
  return finish(impl_, "all_reduce", work, [tensor, buf, op, size]() mutable {
    if (op == ReduceOp::Avg) buf.div_(size);
    if (!buf.is_same(tensor)) tensor.copy_(buf);
    return tensor;
  }, async_op);
}

Work ProcessGroup::all_gather(const at::Tensor& local, int64_t dim,
                              const std::vector<int64_t>& sizes, bool async_op) const {
  if (auto* tape = detail::active_tape()) return taped(*tape, [&] { return all_gather(local, dim, sizes); }, nullptr);
  checkSizes(impl(), "all_gather", sizes);
  dim = c10::maybe_wrap_dim(dim, local.dim());
  TORCH_CHECK(local.size(dim) == sizes[impl().rank], "ProcessGroup::all_gather: local tensor has ",
              local.size(dim), " elements along dim ", dim, ", but sizes[", impl().rank,
              "] = ", sizes[impl().rank], ".");
  const int64_t total = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
  if (impl().size == 1) return Work::ready(local);
  // Every rank's shard, flattened and padded to the largest one.
  std::vector<int64_t> numels;
  for (int64_t s : sizes) numels.push_back(numelOf(chunkShape(local, dim, s)));
  const int64_t max_numel = *std::max_element(numels.begin(), numels.end());
  check_collective(impl(), {"all_gather", c10::str("all_gather of ", shapeText(local), " along dim ", dim,
                                                   " with sizes ", listText(sizes)),
                            local.scalar_type(), std::vector<int64_t>(impl().size, max_numel),
                            std::vector<int64_t>(impl().size, max_numel)});
  const int64_t gathered = numelOf(chunkShape(local, dim, total));
  if (gathered == 0) return Work::ready(at::empty(chunkShape(local, dim, total), local.options()));
  const detail::TraceSpan span = counted(CollectiveType::AllGather, gathered * local.element_size(), impl().global_ranks);
  auto via = [&](auto* path) {
    return viaShm(impl_, "all_gather", [&] {
      at::Tensor out = at::empty({gathered}, local.options());
      path->all_gather(local.contiguous().view({-1}), numels, out);
      if (dim == 0) return out.view(chunkShape(local, dim, total));
      std::vector<at::Tensor> pieces;
      int64_t offset = 0;
      for (size_t r = 0; r < sizes.size(); ++r) {
        pieces.push_back(out.narrow(0, offset, numels[r]).view(chunkShape(local, dim, sizes[r])));
        offset += numels[r];
      }
      return at::cat(pieces, dim);
    });
  };
  if (auto* shm = shmFor(impl(), local, max_numel * local.element_size())) return via(shm);
  if (auto* two_level = twoLevelFor(impl(), local, max_numel * local.element_size())) return via(two_level);
  at::Tensor in = local.contiguous().view({-1});
  if (in.numel() < max_numel) {
    in = at::cat({in, in.new_zeros({max_numel - in.numel()})});
  }
  at::Tensor out = at::empty({impl().size, max_numel}, local.options());
  std::vector<std::vector<at::Tensor>> outs(1);
  for (int r = 0; r < impl().size; ++r) outs[0].push_back(wire(out[r]));
  std::vector<at::Tensor> ins{wire(in)};
  auto work = issue(impl(), in, [&](compat::Backend& b) { return b.allgather(outs, ins); });
  const bool even = std::all_of(numels.begin(), numels.end(),
                                [&](int64_t n) { return n == max_numel; });
  return finish(impl_, "all_gather", work, [=] {
    if (even && dim == 0) {
      auto shape = local.sizes().vec();
      shape[0] = total;
      return out.view(shape);
    }
    std::vector<at::Tensor> pieces;
    for (size_t r = 0; r < sizes.size(); ++r)
      pieces.push_back(out[r].narrow(0, 0, numels[r]).view(chunkShape(local, dim, sizes[r])));
    return at::cat(pieces, dim);
  }, async_op);
}

namespace {

// all_to_all over flattened buffers with per-peer element counts; `what`
// and `call` describe it for NOTE: [Collective checks].
c10::intrusive_ptr<c10d::Work> allToAllFlat(const ProcessGroup::Impl& g, const char* what,
                                             const std::string& call, at::Tensor& out, at::Tensor& in,
                                             std::vector<int64_t> out_counts,
                                             std::vector<int64_t> in_counts) {
  check_collective(g, {what, call, in.scalar_type(), in_counts, out_counts});
  at::Tensor out_wire = wire(out), in_wire = wire(in);
  return issue(g, in, [&](compat::Backend& b) { return b.alltoall_base(out_wire, in_wire, out_counts, in_counts); });
}

// Shape of `t` with `dim` moved to the front and resized.
std::vector<int64_t> frontShape(const at::Tensor& t, int64_t dim, int64_t front,
                                int64_t other_dim = -1, int64_t other = 0) {
  auto shape = t.sizes().vec();
  if (other_dim >= 0) shape[other_dim] = other;
  shape.erase(shape.begin() + dim);
  shape.insert(shape.begin(), front);
  return shape;
}

}  // namespace

Work ProcessGroup::reduce_scatter(const at::Tensor& input, int64_t dim,
                                  const std::vector<int64_t>& sizes, ReduceOp op,
                                  bool async_op) const {
  if (auto* tape = detail::active_tape())
    return taped(*tape, [&] { return reduce_scatter(input, dim, sizes, op); }, nullptr);
  checkSizes(impl(), "reduce_scatter", sizes);
  dim = c10::maybe_wrap_dim(dim, input.dim());
  const int64_t total = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
  TORCH_CHECK(input.size(dim) == total, "ProcessGroup::reduce_scatter: input has ", input.size(dim),
              " elements along dim ", dim, ", but the per-rank sizes add up to ", total, ".");
  if (impl().size == 1) return Work::ready(op == ReduceOp::Avg ? input.clone() : input);
  if (input.numel() == 0) {
    auto shape = input.sizes().vec();
    shape[dim] = sizes[impl().rank];
    return Work::ready(at::empty(shape, input.options()));
  }
  const detail::TraceSpan span = counted(CollectiveType::ReduceScatter, nbytes(input), impl().global_ranks);

  const int me = impl().rank, W = impl().size;
  at::Tensor in = input.movedim(dim, 0).contiguous().view({-1});
  const int64_t inner = input.numel() == 0 ? numelOf(frontShape(input, dim, 1))
                                           : input.numel() / total;
  std::vector<int64_t> in_counts, out_counts(W, sizes[me] * inner);
  for (int64_t s : sizes) in_counts.push_back(s * inner);
  auto via = [&](auto* path) {
    return viaShm(impl_, "reduce_scatter", [&] {
      const at::Tensor mine = path->reduce_scatter(widened(input) ? in.to(at::kFloat) : in, in_counts, op);
      return mine.to(input.scalar_type()).view(frontShape(input, dim, sizes[me])).movedim(0, dim).contiguous();
    });
  };
  const int64_t slot_bytes = input.numel() * (widened(input) ? 4 : input.element_size());
  if (auto* shm = shmFor(impl(), input, slot_bytes)) return via(shm);
  const std::string call = c10::str("reduce_scatter of ", shapeText(input), " along dim ", dim, " with sizes ",
                                    listText(sizes));
  if (auto* two_level = twoLevelFor(impl(), input, slot_bytes)) {
    check_collective(impl(), {"reduce_scatter", call, in.scalar_type(), in_counts, out_counts});  // as allToAllFlat
    return via(two_level);
  }
  at::Tensor out = at::empty({W * sizes[me] * inner}, input.options());
  auto work = allToAllFlat(impl(), "reduce_scatter", call, out, in, out_counts, in_counts);
  auto recv_shape = frontShape(input, dim, sizes[me]);
  recv_shape.insert(recv_shape.begin(), W);
  return finish(impl_, "reduce_scatter", work, [=] {
    at::Tensor stacked = out.view(recv_shape);
    at::Tensor r;
    switch (op) {
      case ReduceOp::Sum: r = stacked.sum(0); break;
      case ReduceOp::Avg: r = stacked.sum(0).div_(W); break;
      case ReduceOp::Max: r = std::get<0>(stacked.max(0)); break;
      case ReduceOp::Min: r = std::get<0>(stacked.min(0)); break;
    }
    return r.movedim(0, dim).contiguous();
  }, async_op);
}

Work ProcessGroup::all_to_all(const at::Tensor& input, int64_t split_dim,
                              const std::vector<int64_t>& split_sizes, int64_t cat_dim,
                              const std::vector<int64_t>& cat_sizes, bool async_op) const {
  if (auto* tape = detail::active_tape())
    return taped(*tape, [&] { return all_to_all(input, split_dim, split_sizes, cat_dim, cat_sizes); }, nullptr);
  checkSizes(impl(), "all_to_all", split_sizes);
  checkSizes(impl(), "all_to_all", cat_sizes);
  split_dim = c10::maybe_wrap_dim(split_dim, input.dim());
  cat_dim = c10::maybe_wrap_dim(cat_dim, input.dim());
  TORCH_CHECK(split_dim != cat_dim, "dtp: all_to_all needs split_dim != cat_dim.");
  const int me = impl().rank, W = impl().size;
  TORCH_CHECK(input.size(cat_dim) == cat_sizes[me], "ProcessGroup::all_to_all: input has ",
              input.size(cat_dim), " elements along dim ", cat_dim, ", expected cat_sizes[",
              me, "] = ", cat_sizes[me], ".");
  const int64_t split_total = std::accumulate(split_sizes.begin(), split_sizes.end(), int64_t{0});
  TORCH_CHECK(input.size(split_dim) == split_total, "ProcessGroup::all_to_all: input has ",
              input.size(split_dim), " elements along dim ", split_dim,
              ", but split_sizes add up to ", split_total, ".");
  if (W == 1) return Work::ready(input);
  int64_t rest = 1;  // elements per (split, cat) pair: the same on every rank
  for (int64_t d = 0; d < input.dim(); ++d)
    if (d != split_dim && d != cat_dim) rest *= input.size(d);
  const int64_t cat_total = std::accumulate(cat_sizes.begin(), cat_sizes.end(), int64_t{0});
  if (rest * split_total * cat_total == 0) {
    auto shape = input.sizes().vec();
    shape[split_dim] = split_sizes[me];
    shape[cat_dim] = cat_total;
    return Work::ready(at::empty(shape, input.options()));
  }
  const detail::TraceSpan span = counted(CollectiveType::AllToAll, nbytes(input), impl().global_ranks);

  at::Tensor in = input.movedim(split_dim, 0).contiguous().view({-1});
  const int64_t in_inner = numelOf(frontShape(input, split_dim, 1));
  std::vector<int64_t> in_counts, out_counts;
  std::vector<std::vector<int64_t>> recv_shapes;
  for (int r = 0; r < W; ++r) {
    in_counts.push_back(split_sizes[r] * in_inner);
    recv_shapes.push_back(frontShape(input, split_dim, split_sizes[me], cat_dim, cat_sizes[r]));
    out_counts.push_back(numelOf(recv_shapes.back()));
  }
  at::Tensor out = at::empty({std::accumulate(out_counts.begin(), out_counts.end(), int64_t{0})},
                             input.options());
  auto work = allToAllFlat(impl(), "all_to_all",
                           c10::str("all_to_all of ", shapeText(input), " split along dim ", split_dim, " by ",
                                    listText(split_sizes), ", gathered along dim ", cat_dim, " by ",
                                    listText(cat_sizes)),
                           out, in, out_counts, in_counts);
  return finish(impl_, "all_to_all", work, [=] {
    std::vector<at::Tensor> pieces;
    int64_t offset = 0;
    for (int r = 0; r < W; ++r) {
      pieces.push_back(out.narrow(0, offset, out_counts[r]).view(recv_shapes[r]).movedim(0, split_dim));
      offset += out_counts[r];
    }
    return at::cat(pieces, cat_dim);
  }, async_op);
}

Work ProcessGroup::all_to_all_single(const at::Tensor& input, const std::vector<int64_t>& output_split_sizes,
                                     const std::vector<int64_t>& input_split_sizes, bool async_op) const {
  if (auto* tape = detail::active_tape())
    return taped(*tape, [&] { return all_to_all_single(input, output_split_sizes, input_split_sizes); }, nullptr);
  checkSizes(impl(), "all_to_all_single", input_split_sizes);
  checkSizes(impl(), "all_to_all_single", output_split_sizes);
  TORCH_CHECK(input.dim() >= 1, "ProcessGroup::all_to_all_single: input is a scalar; expected rows along dim 0.");
  const int64_t in_rows = std::accumulate(input_split_sizes.begin(), input_split_sizes.end(), int64_t{0});
  const int64_t out_rows = std::accumulate(output_split_sizes.begin(), output_split_sizes.end(), int64_t{0});
  TORCH_CHECK(input.size(0) == in_rows, "ProcessGroup::all_to_all_single: input has ", input.size(0),
              " rows, but input_split_sizes ", listText(input_split_sizes), " add up to ", in_rows, ".");
  auto shape = input.sizes().vec();
  shape[0] = out_rows;
  const int me = impl().rank;
  if (impl().size == 1) {
    TORCH_CHECK(output_split_sizes[0] == input_split_sizes[0], "ProcessGroup::all_to_all_single: one rank sends ",
                input_split_sizes[0], " rows to itself but expects ", output_split_sizes[0], ".");
    return Work::ready(input);
  }
  // Every rank takes part, also one that sends and receives nothing: the
  // others cannot know (their split sizes are theirs).
  const detail::TraceSpan span = counted(CollectiveType::AllToAll, nbytes(input), impl().global_ranks);
  const int64_t row = numelOf(frontShape(input, 0, 1));
  std::vector<int64_t> in_counts, out_counts;
  for (int r = 0; r < impl().size; ++r) {
    in_counts.push_back(input_split_sizes[r] * row);
    out_counts.push_back(output_split_sizes[r] * row);
  }
  at::Tensor in = input.contiguous().view({-1});
  at::Tensor out = at::empty(shape, input.options());
  at::Tensor flat = out.view({-1});
  auto work = allToAllFlat(impl(), "all_to_all_single",
                           c10::str("all_to_all_single of ", shapeText(input), " on rank ", me, ": send ",
                                    listText(input_split_sizes), " rows, receive ", listText(output_split_sizes)),
                           flat, in, out_counts, in_counts);
  return finish(impl_, "all_to_all_single", work, [out] { return out; }, async_op);
}

Work ProcessGroup::broadcast(at::Tensor tensor, int src, bool async_op) const {
  if (auto* tape = detail::active_tape()) return taped(*tape, [&] { return broadcast(tensor, src); }, &tensor);
  TORCH_CHECK(src >= 0 && src < impl().size, "dtp: broadcast from rank ", src,
              " in a group of ", impl().size, " ranks.");
  if (impl().size == 1) return Work::ready(tensor);
  std::vector<int64_t> send(impl().size, impl().rank == src ? tensor.numel() : 0), recv(impl().size, 0);
  recv[src] = tensor.numel();
  check_collective(impl(), {"broadcast", c10::str("broadcast of ", shapeText(tensor), " from rank ", src),
                            tensor.scalar_type(), send, recv});
  if (tensor.numel() == 0) return Work::ready(tensor);
  const detail::TraceSpan span = counted(CollectiveType::Broadcast, nbytes(tensor), impl().global_ranks);
  at::Tensor buf = tensor.is_contiguous() ? tensor : tensor.contiguous();
  auto via = [&](auto* path) {
    return viaShm(impl_, "broadcast", [&] {
      at::Tensor flat = buf.view({-1});
      path->broadcast(flat, src);
      if (!buf.is_same(tensor)) tensor.copy_(buf);
      return tensor;
    });
  };
  if (auto* shm = shmFor(impl(), tensor, nbytes(tensor))) return via(shm);
  if (auto* two_level = twoLevelFor(impl(), tensor, nbytes(tensor))) return via(two_level);
  std::vector<at::Tensor> bufs{wire(buf)};
  c10d::BroadcastOptions opts;
  opts.rootRank = src;
  auto work = issue(impl(), buf, [&](compat::Backend& b) { return b.broadcast(bufs, opts); });
  return finish(impl_, "broadcast", work, [tensor, buf]() mutable {
    if (!buf.is_same(tensor)) tensor.copy_(buf);
    return tensor;
  }, async_op);
}

Work ProcessGroup::scatter(at::Tensor output, const std::vector<at::Tensor>& chunks, int src,
                           bool async_op) const {
  if (auto* tape = detail::active_tape()) return taped(*tape, [&] { return scatter(output, chunks, src); }, &output);
  const int me = impl().rank, W = impl().size;
  TORCH_CHECK(src >= 0 && src < W, "dtp: scatter from rank ", src, " in a group of ", W,
              " ranks.");
  if (me == src) {
    TORCH_CHECK(static_cast<int>(chunks.size()) == W, "dtp: scatter on the source rank needs ",
                W, " chunks, got ", chunks.size(), ".");
    TORCH_CHECK(chunks[me].sizes() == output.sizes(), "ProcessGroup::scatter: the source's own chunk ",
                chunks[me].sizes(), " does not match its output ", output.sizes(), ".");
  }
  if (W == 1) {
    output.copy_(chunks[0]);
    return Work::ready(output);
  }
  int64_t sent = 0;
  for (const auto& c : chunks) sent += nbytes(c);
  const detail::TraceSpan span = counted(CollectiveType::Scatter, me == src ? sent : 0, impl().global_ranks);
  // Scatter as an all_to_all in which only `src` sends: exact sizes, no padding.
  std::vector<int64_t> in_counts(W, 0), out_counts(W, 0);
  out_counts[src] = output.numel();
  at::Tensor in;
  if (me == src) {
    std::vector<at::Tensor> flat;
    for (int r = 0; r < W; ++r) {
      flat.push_back(chunks[r].to(output.options()).contiguous().view({-1}));
      in_counts[r] = flat.back().numel();
    }
    in = at::cat(flat);
  } else {
    in = at::empty({0}, output.options());
  }
  at::Tensor out = output.is_contiguous() ? output : at::empty(output.sizes(), output.options());
  at::Tensor out_flat = out.view({-1});
  auto work = allToAllFlat(impl(), "scatter",
                           c10::str("scatter from rank ", src, " into ", shapeText(output)),
                           out_flat, in, out_counts, in_counts);
  return finish(impl_, "scatter", work, [output, out]() mutable {
    if (!out.is_same(output)) output.copy_(out);
    return output;
  }, async_op);
}

void ProcessGroup::barrier() const {
  if (auto* tape = detail::active_tape(); tape != nullptr && tape->replaying()) return;
  if (impl().size == 1) return;
  const detail::TraceSpan span = counted(CollectiveType::Barrier, 0, impl().global_ranks);
  if (impl().shm) {
    viaShm(impl_, "barrier", [&] {
      impl().shm->barrier();
      return at::Tensor();
    });
    return;
  }
  if (impl().two_level) {
    viaShm(impl_, "barrier", [&] {
      impl().two_level->barrier();
      return at::Tensor();
    });
    return;
  }
  auto work = issue(impl(), at::Tensor(), [](compat::Backend& b) { return b.barrier(); });
  finish(impl_, "barrier", work, [] { return at::Tensor(); }, /*async_op=*/false);
}

ProcessGroup default_process_group() {
  TORCH_CHECK(default_group.valid(),
              "dtp: no default process group on this thread. Call dtp::init_process_group() "
              "first (or set_default_process_group in a test).");
  return default_group;
}

bool is_initialized() { return default_group.valid(); }

void set_default_process_group(ProcessGroup group) { default_group = std::move(group); }

}  // namespace dtp
