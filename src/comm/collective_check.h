// NOTE: [Collective checks] Gloo trusts every rank to post buffers of the
// sizes its peers expect; when ranks disagree (from_local(run_check=false)
// with shards that do not fit one global shape, say), Gloo's transport
// thread throws and the process terminates. With
// ProcessGroupOptions::check_collectives (on when TORCH_DISTRIBUTED_DEBUG=DETAIL,
// PyTorch's switch for the same check), every collective is preceded by one
// small all_gather of what each rank is about to send to and receive from
// every peer; a mismatch is an error on every rank naming each rank's call.
// Off by default: it doubles the number of collectives.
#pragma once

#include "comm/process_group_impl.h"

#include <string>
#include <vector>

namespace dtp {

// What one rank is about to put on the wire in a collective.
struct WireContract {
  const char* what;              // "all_gather", ...
  std::string call;              // readable: shapes, dims and per-rank sizes as passed
  at::ScalarType dtype;
  std::vector<int64_t> send;     // elements sent to each group rank
  std::vector<int64_t> recv;     // elements expected from each group rank
};

// True when options ask for it; then throws unless every rank's contract fits
// the others'. A collective itself (not counted by CommCounter).
void check_collective(const ProcessGroup::Impl& g, const WireContract& c);

// Prints what a Gloo transport abort (a size mismatch between ranks) means
// and how to find the collective, before the process terminates. Idempotent.
void install_gloo_abort_hint();

}  // namespace dtp
