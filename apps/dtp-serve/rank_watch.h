// Rank 0's watch over the ranks of its host, so that a rank that dies (kill
// -9, the OOM killer) is named to the clients at once:
//   RankPids pids = gather_rank_pids(world);   // collective, at start-up
//   std::string who = gone_rank(pids);        // "rank 1 (pid 4242)", or ""
// NOTE: [A dead rank] When a rank dies mid-step, the next collective fails
// on rank 0 too, and its error names the rank that did not arrive, but only
// after a few seconds of asking the store (NOTE: [Who did not arrive] in
// src/comm/collective_failure.cpp), and a launcher such as dtprun stops
// the other ranks within 3 s. So rank 0 also polls the processes of the
// ranks on its host: within ~100 ms of a death every open request gets a 503
// naming the rank, /health answers 503, and the step loop's own failure then
// ends the server with a non-zero status. Ranks on other hosts are named by
// the collective's error.
#pragma once

#include "dtp/process_group.h"

#include <cstdint>
#include <string>
#include <vector>

namespace dtp::serve {

struct RankPids {
  std::vector<int64_t> pid;
  std::vector<char> same_host;  // as rank 0
};

// Every rank's process id and whether it runs on rank 0's host (one
// all_gather of the world).
RankPids gather_rank_pids(const ProcessGroup& world);

// The first rank of rank 0's host whose process is gone (or a zombie), as
// "rank R (pid P)"; empty when all are alive.
std::string gone_rank(const RankPids& pids);

}  // namespace dtp::serve
