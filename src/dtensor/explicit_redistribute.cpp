#include "dtp/explicit_redistribute.h"

#include "dtensor/explicit_redistribute.h"
#include "dtensor/dispatch_context.h"
#include "dtensor/op_args.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

namespace dtp {
namespace {

ExplicitRedistributeMode fromEnvironment() {
  const char* v = std::getenv("DTP_EXPLICIT_REDISTRIBUTE");
  if (v == nullptr || std::strcmp(v, "") == 0 || std::strcmp(v, "0") == 0) return ExplicitRedistributeMode::Off;
  if (std::strcmp(v, "1") == 0) return ExplicitRedistributeMode::Error;
  if (std::strcmp(v, "warn") == 0) return ExplicitRedistributeMode::Warn;
  TORCH_CHECK(false, "DTP_EXPLICIT_REDISTRIBUTE=", v, " is not understood. Use 1 (implicit redistributions are "
              "errors), warn (warnings, once per op and input specs) or 0 (off).");
  return ExplicitRedistributeMode::Off;
}

ExplicitRedistributeMode environmentMode() {
  static const ExplicitRedistributeMode mode = fromEnvironment();
  return mode;
}

}  // namespace

// A scope of the context's switch (NOTE: [Dispatch context]): the innermost
// live guard decides, whatever order guards are destroyed in.
ExplicitRedistributeGuard::ExplicitRedistributeGuard(ExplicitRedistributeMode mode) {
  detail::dispatch_context().explicit_redistribute.enter(this, mode);
}

ExplicitRedistributeGuard::~ExplicitRedistributeGuard() { detail::dispatch_context().explicit_redistribute.leave(this); }

ExplicitRedistributeMode ExplicitRedistributeGuard::mode() {
  const auto& modes = detail::dispatch_context().explicit_redistribute;
  return modes.depth() == 0 ? environmentMode() : modes.get(ExplicitRedistributeMode::Off);
}

bool explicit_redistribute_active() { return ExplicitRedistributeGuard::mode() != ExplicitRedistributeMode::Off; }

void check_implicit_redistribution(const OpCall& call, const PlannedDecision& d) {
  std::ostringstream what;
  bool found = false;
  for (size_t s = 0; s < call.specs.size(); ++s) {
    const DTensorSpec& spec = call.spec(s);
    if (spec.placements == d.in[s]) continue;
    std::vector<std::string> collectives;
    for (const auto& step : d.in_plans[s]) {
      if (step.collective)
        collectives.push_back(std::string(to_string(*step.collective)) + " on mesh dim " +
                              std::to_string(step.mesh_dim));
    }
    if (collectives.empty()) continue;
    what << (found ? "; " : "") << "input " << s << " " << spec.str() << " to " << to_string(d.in[s]) << " (";
    for (size_t i = 0; i < collectives.size(); ++i) what << (i ? ", " : "") << collectives[i];
    what << ", " << spec.numel() * static_cast<int64_t>(c10::elementSize(spec.dtype)) << " B global)";
    found = true;
  }
  if (!found) return;
  const std::string msg = "dtp: " + op_name(call.op) + " would redistribute implicitly (explicit-redistribution "
                          "mode): " + what.str() + ". Redistribute explicitly with dtp::redistribute (or a style's "
                          "layouts) before the op, or place the tensors where its rule wants them.";
  if (ExplicitRedistributeGuard::mode() == ExplicitRedistributeMode::Error) TORCH_CHECK(false, msg);
  static std::mutex mutex;
  static std::unordered_set<std::string> warned;
  std::lock_guard<std::mutex> lock(mutex);
  if (warned.insert(msg).second) TORCH_WARN(msg);
}

}  // namespace dtp
