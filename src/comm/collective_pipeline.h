// NOTE: [Collective pipeline] Every collective of a ProcessGroup takes the
// same steps, in this order, written once in run_collective below; a
// collective is a small "call" type (collectives.cpp) that says what each
// step needs and nothing else:
//   - validate: the ProcessGroup method checks its arguments ("dtp:
//     <collective>: ..." errors) before anything else, on every rank count;
//   - tape: under a result tape (NOTE: [Result tape]), a replay returns the
//     kept result and a recording runs the rest synchronously and keeps it;
//   - one rank: a group of one returns at once (call.one_rank());
//   - the cross-rank check (NOTE: [Collective checks]), when asked for:
//     call.contract() says what this rank sends and expects, on every path
//     alike;
//   - nothing to move: a collective empty on every rank returns unchecked by
//     Gloo and uncounted (NOTE: [Zero-size collectives]);
//   - count and trace: CommCounter and a profiler span (NOTE: [Trace
//     spans]) for the rest of the call;
//   - the path: a LocalPath (shared memory or two-level) when the group has
//     one, the tensor is on the CPU, call.local_bytes() fits and the path
//     does not decline (alike on every rank: NOTE: [Shared-memory
//     all_to_all]), else the c10d backend of the tensor's device (Gloo or
//     NCCL; NOTE: [Backends per device]) through call.issue(). With
//     async_op, a LocalPath collective runs on the group's progress thread
//     (NOTE: [Async collectives on a LocalPath]); c10d's are asynchronous
//     by themselves, waited for at Work::wait();
//   - finish: the collective gets its number on the group, and a failure
//     becomes one line naming it and the ranks that did not arrive (NOTE:
//     [Who did not arrive]).
// A call type provides:
//   static constexpr CollectiveType kType; static constexpr const char* kWhat;
//   static constexpr bool kKeepsResult (tape), kHasLocalPath;
//   static constexpr bool kAsyncLocal;  (when kHasLocalPath) the progress thread may run it: the
//                                    call owns what it reads (copied into the task) and its path never declines
//   at::Tensor* in_place();          the tensor a replayed result is copied into, or null
//   const at::Tensor& carrier();     the tensor whose device picks the backend (undefined: Gloo)
//   at::Tensor one_rank();  WireContract contract();  bool empty();  at::Tensor empty_result();
//   int64_t bytes();                 CommCounter's bytes
//   int64_t local_bytes();           (when kHasLocalPath)
//   bool local(LocalPath&, at::Tensor& result);  false: the path declined
//   c10::intrusive_ptr<c10d::Work> issue(const ProcessGroup::Impl&);  then(): a callable
//                                    that makes the result once the c10d work is done
// No step allocates beyond what the collective itself needs; the contract
// (strings) is built only when the check runs.
#pragma once

#include "comm/collective_check.h"
#include "comm/local_path.h"
#include "comm/process_group_impl.h"
#include "comm/progress_thread.h"
#include "comm/result_tape.h"
#include "comm/trace_span.h"
#include "comm/two_level.h"
#include "dtp/comm_counter.h"

#include <ATen/ThreadLocalState.h>

#include <exception>
#include <future>
#include <memory>
#include <utility>

namespace dtp::detail {

// Counts a collective (CommCounter) and names it for profilers until the
// caller returns (NOTE: [Trace spans]).
inline TraceSpan count_and_trace(CollectiveType type, int64_t bytes, const std::vector<int>& ranks) {
  CommCounter::record(type, bytes, ranks);
  return TraceSpan([&] { return c10::str(to_string(type), " ", bytes, " B over ranks ", c10::ArrayRef<int>(ranks)); });
}

// The in-memory path for a collective that puts `bytes` into each rank's
// slot: CPU tensors up to the slot size, on groups that have one (NOTE:
// [Shared-memory collectives], NOTE: [Two-level collectives]); every member
// decides alike, from shapes every member knows. Null: c10d carries it.
inline LocalPath* local_path_for(const ProcessGroup::Impl& g, const at::Tensor& t, int64_t bytes) {
  if (g.local_path == nullptr || (t.defined() && t.is_cuda())) return nullptr;
  return bytes <= g.local_path->max_bytes() ? g.local_path : nullptr;
}

// Waits for a c10d work (now, or at wait() when `async_op`) and turns a peer
// failure into one readable line that names the collective, the group, the
// ranks that did not arrive and why; then makes the result with `then`.
template <class Then>
Work await_collective(const std::shared_ptr<ProcessGroup::Impl>& group, const char* what,
                      c10::intrusive_ptr<c10d::Work> work, Then&& then, bool async_op) {
  const int64_t n = ++group->collectives;
  // Holds the group: an async Work may outlive the caller's handle.
  Work result([group, n, what, work = std::move(work), then = std::forward<Then>(then)]() mutable {
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

template <class Call>
Work run_collective(const std::shared_ptr<ProcessGroup::Impl>& group, Call& call, bool async_op);

// The group's in-memory path, kept alive by a task of its progress thread.
inline std::shared_ptr<LocalPath> local_path_owner(const ProcessGroup::Impl& g) {
  if (g.shm) return g.shm;
  return g.two_level;
}

// See NOTE: [Async collectives on a LocalPath]: `call` (copied) runs on the
// group's progress thread, under the caller's thread-local state (grad and
// inference mode); the Work waits for it and names a failure as
// await_collective does.
template <class Call>
Work run_local_async(const std::shared_ptr<ProcessGroup::Impl>& group, const Call& call) {
  ProcessGroup::Impl& g = *group;
  const int64_t n = ++g.collectives;
  if (g.progress == nullptr) g.progress = std::make_shared<ProgressThread>();
  auto done = std::make_shared<std::promise<at::Tensor>>();
  std::shared_future<at::Tensor> result = done->get_future().share();
  g.progress->submit([done, call = Call(call), path = local_path_owner(g), state = at::ThreadLocalState()]() mutable {
    const at::ThreadLocalStateGuard guard(state);
    try {
      at::Tensor out;
      TORCH_INTERNAL_ASSERT(call.local(*path, out), Call::kWhat, ": an async in-memory collective was declined");
      done->set_value(std::move(out));
    } catch (...) {
      done->set_exception(std::current_exception());
    }
  });
  return Work([group, n, result] {
    try {
      return result.get();
    } catch (const std::exception& e) {
      explain_failure(*group, Call::kWhat, n, e);
    }
  });
}

// NOTE: [Result tape]: while recording, the collective completes and a copy
// of its result is kept; while replaying, the kept result stands in (copied
// into the in-place target, if any).
template <class Call>
Work run_taped(ResultTape& tape, const std::shared_ptr<ProcessGroup::Impl>& group, Call& call) {
  if (tape.replaying()) {
    if constexpr (!Call::kKeepsResult) return Work::ready(at::Tensor());
    const at::Tensor& kept = tape.pop();
    at::Tensor* target = call.in_place();
    if (target == nullptr) return Work::ready(kept);
    target->copy_(kept);
    return Work::ready(*target);
  }
  at::Tensor result;
  {
    TapeBypass bypass;
    result = run_collective(group, call, /*async_op=*/false).wait();
  }
  if constexpr (Call::kKeepsResult) tape.push(result.defined() ? result.clone() : result);
  return Work::ready(result);
}

// See NOTE: [Collective pipeline]; the caller has validated the arguments.
template <class Call>
Work run_collective(const std::shared_ptr<ProcessGroup::Impl>& group, Call& call, bool async_op) {
  ProcessGroup::Impl& g = *group;
  if (ResultTape* tape = active_tape()) return run_taped(*tape, group, call);
  if (g.size == 1) return Work::ready(call.one_rank());
  if (g.options.check_collectives) check_collective(g, call.contract());
  if (call.empty()) return Work::ready(call.empty_result());
  const TraceSpan span = count_and_trace(Call::kType, call.bytes(), g.global_ranks);
  if constexpr (Call::kHasLocalPath) {
    if (LocalPath* path = local_path_for(g, call.carrier(), call.local_bytes())) {
      if constexpr (Call::kAsyncLocal) {
        if (async_op) return run_local_async(group, call);
      }
      if (g.progress != nullptr) g.progress->drain();  // none of its queued collectives may be overtaken
      const int64_t n = g.collectives + 1;  // the path is synchronous: done when it returns
      at::Tensor result;
      try {
        if (call.local(*path, result)) {
          g.collectives = n;
          return Work::ready(std::move(result));
        }
      } catch (const std::exception& e) {
        g.collectives = n;
        explain_failure(g, Call::kWhat, n, e);
      }
    }
  }
  c10::intrusive_ptr<c10d::Work> work = call.issue(g);
  return await_collective(group, Call::kWhat, std::move(work), call.then(), async_op);
}

}  // namespace dtp::detail
