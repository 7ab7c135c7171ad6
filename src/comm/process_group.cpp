#include "dtp/process_group.h"

#include "comm/collective_check.h"
#include "comm/error_text.h"
#include "comm/gloo.h"
#include "comm/local_device.h"
#include "comm/two_level.h"

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
  g.local_path = g.shm ? static_cast<detail::LocalPath*>(g.shm.get()) : g.two_level.get();
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

ProcessGroup default_process_group() {
  TORCH_CHECK(default_group.valid(),
              "dtp: no default process group on this thread. Call dtp::init_process_group() "
              "first (or set_default_process_group in a test).");
  return default_group;
}

bool is_initialized() { return default_group.valid(); }

void set_default_process_group(ProcessGroup group) { default_group = std::move(group); }

}  // namespace dtp
