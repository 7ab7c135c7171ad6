// dtp's communication layer: a process group over c10d (Gloo for CPU tensors,
// NCCL for CUDA tensors) with collectives that accept uneven sizes.
//
// Every collective takes the local tensor of this rank and the per-rank sizes
// along the dimension that differs, so uneven shards (torch.chunk semantics:
// trailing ranks short or empty) need no special casing by the caller.
// See NOTE: [Uneven shards] in src/comm/process_group.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>


namespace dtp {

enum class ReduceOp : uint8_t { Sum, Avg, Max, Min };
std::string to_string(ReduceOp op);

// The result of a collective. wait() blocks until it finished and returns its
// output tensor (for in-place collectives, the tensor that was passed in).
class Work {
 public:
  Work() = default;
  explicit Work(std::function<at::Tensor()> wait_fn) : wait_fn_(std::move(wait_fn)) {}
  static Work ready(at::Tensor result);
  // Waits once; later calls return the same tensor.
  at::Tensor wait();

 private:
  std::function<at::Tensor()> wait_fn_;
  at::Tensor result_;
  bool done_ = false;
};

// One message of ProcessGroup::batch_isend_irecv (torch.distributed.P2POp).
struct P2POp {
  enum Kind : uint8_t { Send, Recv };
  Kind kind;
  at::Tensor tensor;  // sent, or received into (in place)
  int peer;           // group rank
  int tag = 0;
};

struct ProcessGroupOptions {
  // Every group uses Gloo for CPU tensors; for CUDA tensors NCCL with "nccl",
  // or with "auto" when dtp was built with NCCL and CUDA is usable; "gloo":
  // none (a CUDA tensor is then an error).
  std::string backend = "auto";
  // How long a collective or the rendezvous waits for a peer before failing.
  std::chrono::milliseconds timeout = std::chrono::seconds(300);
  // Address the Gloo transport binds to; empty: loopback for single-node jobs,
  // the host's own address otherwise.
  std::string bind_address;
  // Before each collective, check that what every rank sends is what its
  // peers expect, and fail with each rank's call when not (one extra small
  // collective each). Also on when TORCH_DISTRIBUTED_DEBUG=DETAIL.
  // See NOTE: [Collective checks] in src/comm/collective_check.h.
  bool check_collectives = false;
};

class ProcessGroup {
 public:
  struct Impl;
  ProcessGroup() = default;
  explicit ProcessGroup(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

  // A group of `size` ranks that meet through `store` (for example an
  // in-memory HashStore shared by threads, or a TCPStore).
  static ProcessGroup create(const c10::intrusive_ptr<c10d::Store>& store,
                             int rank, int size,
                             const ProcessGroupOptions& options = {});

  bool valid() const { return impl_ != nullptr; }
  int rank() const;
  int size() const;
  // Ranks of the members in the world group, in group-rank order.
  const std::vector<int>& global_ranks() const;
  const std::string& backend_name() const;
  std::string str() const;

  // A sub-group of the world. Collective over this group: every member calls
  // it with the same `ranks` (group ranks of this group), in the same order
  // relative to other new_group calls. Non-members get an invalid group.
  ProcessGroup new_group(const std::vector<int>& ranks) const;

  // In-place; wait() returns `tensor`.
  Work all_reduce(at::Tensor tensor, ReduceOp op = ReduceOp::Sum,
                  bool async_op = false) const;
  // Concatenation along `dim` of every rank's `local`; rank r's local has
  // `sizes[r]` elements along `dim`.
  Work all_gather(const at::Tensor& local, int64_t dim,
                  const std::vector<int64_t>& sizes, bool async_op = false) const;
  // `input` is split along `dim` into pieces of `sizes`; this rank receives the
  // reduction of everyone's piece `rank()`.
  Work reduce_scatter(const at::Tensor& input, int64_t dim,
                      const std::vector<int64_t>& sizes,
                      ReduceOp op = ReduceOp::Sum, bool async_op = false) const;
  // Splits `input` along `split_dim` into `split_sizes` and sends piece q to
  // rank q; the pieces received are concatenated along `cat_dim`, where rank
  // r's piece has `cat_sizes[r]` elements.
  Work all_to_all(const at::Tensor& input, int64_t split_dim,
                  const std::vector<int64_t>& split_sizes, int64_t cat_dim,
                  const std::vector<int64_t>& cat_sizes, bool async_op = false) const;
  // torch.distributed.all_to_all_single with split sizes: rows
  // [sum(input_split_sizes[:q]), +input_split_sizes[q]) of `input` (dim 0)
  // go to rank q; the rows received from each rank are concatenated in rank
  // order, output_split_sizes[r] of them from rank r. Sizes differ between
  // ranks (a rank may send or receive nothing); what rank r sends to q must
  // be what q expects from r (checked under check_collectives). Expert
  // parallelism's token dispatch. CPU tensors of ranks on one host go
  // through shared memory when every rank's pieces fit a slot
  // (DTP_SHM_MAX_BYTES), else Gloo; CUDA tensors through NCCL.
  Work all_to_all_single(const at::Tensor& input, const std::vector<int64_t>& output_split_sizes,
                         const std::vector<int64_t>& input_split_sizes, bool async_op = false) const;
  // In-place from `src` (a group rank).
  Work broadcast(at::Tensor tensor, int src, bool async_op = false) const;
  // On `src`, `chunks` holds one tensor per rank; every rank receives its
  // chunk into `output` (shapes may differ between ranks).
  Work scatter(at::Tensor output, const std::vector<at::Tensor>& chunks, int src,
               bool async_op = false) const;
  void barrier() const;

  // Point-to-point between group ranks, as torch.distributed's send, recv,
  // isend, irecv and batch_isend_irecv. The receiver's `tensor` must have the
  // sender's dtype and shape (checked when the message is in: an error naming
  // both, never garbage); a send and a recv match when they
  // name each other and the same tag, in the order issued. A failure (a peer
  // that never sends, exits or mismatches) names the peer and whether it
  // reached the message, as collectives do. Counted by CommCounter as
  // send/recv with their bytes. See NOTE: [Point-to-point] in src/comm/p2p.cpp.
  void send(const at::Tensor& tensor, int dst, int tag = 0) const;
  void recv(at::Tensor tensor, int src, int tag = 0) const;
  Work isend(const at::Tensor& tensor, int dst, int tag = 0) const;
  Work irecv(at::Tensor tensor, int src, int tag = 0) const;
  // Starts every message at once (so exchanges in both directions cannot
  // deadlock) and returns their Works, in order.
  std::vector<Work> batch_isend_irecv(const std::vector<P2POp>& ops) const;

  bool operator==(const ProcessGroup& other) const { return impl_ == other.impl_; }

 private:
  // The group's state; a clear error on an invalid (default) handle.
  Impl& impl() const;
  std::shared_ptr<Impl> impl_;
};

// Joins the job described by the environment, exactly as torchrun sets it
// (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
// or as mpirun (OMPI_COMM_WORLD_*) or srun (SLURM_*) do. Makes the result the
// default group of this thread.
ProcessGroup init_process_group(const ProcessGroupOptions& options = {});

// The default (world) group of this thread; throws when none was set.
ProcessGroup default_process_group();
bool is_initialized();
// Sets (or with an invalid group, clears) this thread's default group.
void set_default_process_group(ProcessGroup group);

}  // namespace dtp
