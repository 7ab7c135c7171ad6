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
  std::vector<std::string> command; // program and its arguments, untouched
};

} // namespace dtprun
