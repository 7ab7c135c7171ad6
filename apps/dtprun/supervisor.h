// Runs the local ranks of a job to completion.
#pragma once

#include "launch_options.h"

namespace dtprun {

// Starts options.nproc_per_node ranks, relays their output with a
// "[rank R] " prefix, and waits for all of them. Returns dtprun's exit code:
// - 0 when every rank exits 0;
// - the first failed rank's exit status, or 128+signal if a signal killed it;
//   the other ranks get SIGTERM, then SIGKILL after a grace period;
// - 128+signal when dtprun receives SIGINT, SIGTERM or SIGHUP, which it
//   forwards to every rank (a second one kills them at once);
// - 127 when the program cannot be executed.
// Never leaves a rank or anything in a rank's process group running.
// `interrupted` (if given) tells whether dtprun itself received a signal.
int run_ranks(const LaunchOptions& options, bool* interrupted = nullptr);

} // namespace dtprun
