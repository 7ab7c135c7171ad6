// What the command line asks dtprun to run.
#pragma once

#include <string>
#include <vector>

namespace dtprun {

struct LaunchOptions {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0; // resolved before launch: given, free, or 29500
  int max_restarts = 0; // --max-restarts: how often all local ranks are started again after a failure
  int restart_count = 0; // this attempt: 0, then 1, 2, ... (TORCHELASTIC_RESTART_COUNT)
  std::vector<std::string> command; // program and its arguments, untouched
};

} // namespace dtprun
