// Point-to-point: send, recv, isend, irecv, batch_isend_irecv.
#include "comm/result_tape.h"
#include "comm/process_group_impl.h"
#include "comm/trace_span.h"
#include "dtp/comm_counter.h"
#include "dtp/process_group.h"

#include <ATen/ATen.h>

namespace dtp {

namespace {

// NOTE: [Point-to-point]
// Messages go straight to the group's backend (Gloo for CPU tensors, NCCL
// for CUDA ones): no shared-memory path. The sender writes each message's
// dtype and shape to the job's store under the message's number; the
// receiver reads it (and deletes it), a blocking recv before it posts the
// receive, an irecv once the bytes are in, and a buffer of another dtype,
// element count or shape is an error naming both, never garbage (Gloo takes
// any buffer of at least the bytes sent; a smaller one aborts the process
// inside Gloo, with dtp's hint: recv refuses it before that). The price of
// recv's early look: a sender that dies before its send is seen when the
// store's wait for its descriptor times out (DTP_TIMEOUT_S), not when its
// connection closes; irecv (the pipeline's) keeps the fast failure. Costs one store write,
// read and delete per message: measured between 2 processes on one 2-vCPU
// host, a 1 KiB ping-pong message took ~120-220 us against ~55-90 us
// without the check, a 1 MiB one the same within noise (~410-500 us).
// Both ends
// number the messages per (source, destination, tag), so that on a failure
// each finds the same message in the store and tells whether the peer
// reached it (NOTE: [Who did not arrive]). A message with no elements is
// skipped at both ends (each knows its own size; were the sizes to differ,
// the end with elements fails, naming the other).
std::string descriptor(const at::Tensor& t) { return c10::str(c10::toString(t.scalar_type()), t.sizes()); }

// The user's errors in one message, before anything is posted; `api` names
// the call ("ProcessGroup::send", "ProcessGroup::batch_isend_irecv: op 1 (recv)").
void checkOp(const ProcessGroup::Impl& g, const P2POp& op, const std::string& api) {
  const bool send = op.kind == P2POp::Send;
  TORCH_CHECK(op.peer >= 0 && op.peer < g.size, api, ": peer ", op.peer,
              " is not a rank of this size-", g.size, " group. Name a group rank in [0, ", g.size, ").");
  TORCH_CHECK(op.peer != g.rank, api, ": group rank ", g.rank, " names itself as the peer. Copy the tensor instead.");
  TORCH_CHECK(op.tensor.defined(), api, ": the tensor is undefined. Pass the tensor to ",
              send ? "send." : "receive into (preallocated with the sender's shape and dtype).");
  TORCH_CHECK(detail::active_tape() == nullptr, api,
              ": NYI: point-to-point inside an activation-checkpointed region (its recomputation would send "
              "again). Send and receive outside checkpointed modules.");
}

// The receiving buffer against what the sender wrote for message `n`.
void checkReceived(const ProcessGroup::Impl& g, const std::vector<uint8_t>& sent, const at::Tensor& target, int src,
                   int tag, int64_t n, bool before) {
  const std::string theirs(sent.begin(), sent.end()), mine = descriptor(target);
  TORCH_CHECK(theirs == mine, "ProcessGroup::recv: message #", n, " from global rank ", g.global_ranks[src], " (tag ",
              tag, ") is ", theirs, ", but the receiving tensor is ", mine, ". Receive into a tensor of the sender's "
              "dtype and shape.", before ? " Nothing was received: the message waits for a receive that fits it." : "");
}

// `check_first` (a blocking recv, which waits for the sender anyway): the
// sender's descriptor is read before the receive is posted, so a buffer that
// does not fit is refused before any byte moves (a smaller one would abort
// inside Gloo) and the message stays for the next receive. An irecv cannot
// wait for its sender before returning (two ranks that each irecv before
// they isend would deadlock): it checks once the bytes are in.
Work start(const std::shared_ptr<ProcessGroup::Impl>& impl, const P2POp& op, bool check_first = false) {
  const ProcessGroup::Impl& g = *impl;
  const bool send = op.kind == P2POp::Send;
  const char* what = send ? "send" : "recv";
  checkOp(g, op, c10::str("ProcessGroup::", what));
  const int src = send ? g.rank : op.peer, dst = send ? op.peer : g.rank, tag = op.tag;
  int64_t& count = g.p2p_messages[{src, dst, tag}];
  const int64_t n = count + 1;
  const std::string key = c10::str(g.prefix, "/dtp.p2p/", src, "-", dst, "/", tag, "/", n);
  const bool checked = !send && check_first && op.tensor.numel() > 0;
  if (checked) {
    std::vector<uint8_t> sent;
    try {
      sent = g.root_store->get(key);  // waits for the sender, as the receive would
    } catch (const std::exception& e) {
      count = n;  // the peer's failure is named under this message's number
      explain_p2p_failure(g, what, src, dst, tag, n, e);
    }
    checkReceived(g, sent, op.tensor, src, tag, n, /*before=*/true);
    g.root_store->deleteKey(key);
  }
  count = n;
  const int64_t bytes = op.tensor.numel() * static_cast<int64_t>(op.tensor.element_size());
  const std::vector<int> pair{g.global_ranks[src], g.global_ranks[dst]};
  CommCounter::record(send ? CollectiveType::Send : CollectiveType::Recv, bytes, pair);
  const detail::TraceSpan span([&] { return c10::str(what, " ", bytes, " B from rank ", pair[0], " to ", pair[1]); });
  if (op.tensor.numel() == 0) return Work::ready(op.tensor);
  if (send) {
    const std::string d = descriptor(op.tensor);
    g.root_store->set(key, std::vector<uint8_t>(d.begin(), d.end()));
  }
  at::Tensor buf = op.tensor.is_contiguous() ? op.tensor : op.tensor.contiguous();
  std::vector<at::Tensor> bufs{buf};
  c10::intrusive_ptr<c10d::Work> work = issue_on_backend(g, buf, [&](compat::Backend& b) {
    return send ? b.send(bufs, dst, tag) : b.recv(bufs, src, tag);
  });
  at::Tensor target = op.tensor;
  // Holds the group: the Work may outlive the caller's handle.
  return Work([impl, what, send, checked, src, dst, tag, n, key, work = std::move(work), buf, target]() mutable {
    try {
      work->wait();
    } catch (const std::exception& e) {
      explain_p2p_failure(*impl, what, src, dst, tag, n, e);
    }
    if (!send && !checked) {
      const std::vector<uint8_t> sent = impl->root_store->get(key);
      impl->root_store->deleteKey(key);
      checkReceived(*impl, sent, target, src, tag, n, /*before=*/false);
    }
    if (!buf.is_same(target)) target.copy_(buf);  // received into a non-contiguous tensor
    return target;
  });
}

}  // namespace

Work ProcessGroup::isend(const at::Tensor& tensor, int dst, int tag) const {
  impl();  // a named error on an invalid group
  return start(impl_, {P2POp::Send, tensor, dst, tag});
}

Work ProcessGroup::irecv(at::Tensor tensor, int src, int tag) const {
  impl();
  return start(impl_, {P2POp::Recv, std::move(tensor), src, tag});
}

void ProcessGroup::send(const at::Tensor& tensor, int dst, int tag) const { isend(tensor, dst, tag).wait(); }

void ProcessGroup::recv(at::Tensor tensor, int src, int tag) const {
  impl();
  start(impl_, {P2POp::Recv, std::move(tensor), src, tag}, /*check_first=*/true).wait();
}

std::vector<Work> ProcessGroup::batch_isend_irecv(const std::vector<P2POp>& ops) const {
  impl();
  for (const auto& op : ops)
    TORCH_CHECK(!op.tensor.defined() || !op.tensor.is_cuda(), "ProcessGroup::batch_isend_irecv: NYI on CUDA tensors "
                "(NCCL needs the messages grouped). Issue isend/irecv in an order that matches on both ends.");
  // Every op is checked before the first is posted: a bad op after a posted
  // send would leave that message for a later receive to pick up.
  for (size_t i = 0; i < ops.size(); ++i)
    checkOp(*impl_, ops[i], c10::str("ProcessGroup::batch_isend_irecv: op ", i, " (",
                                     ops[i].kind == P2POp::Send ? "send" : "recv", ")"));
  std::vector<Work> works;
  works.reserve(ops.size());
  for (const auto& op : ops) works.push_back(start(impl_, op));
  return works;
}

}  // namespace dtp
