// A hint for dispatch's "mix of plain at::Tensor and DTensor" error, set by
// a higher layer while its forward runs.
#pragma once

#include <memory>
#include <string>

namespace dtp::detail {

// NOTE: [Mix hints] A technique above the DTensor core sometimes knows why a
// plain tensor may meet a DTensor: fully_shard on a mesh with "tp" turns the
// parameters no TP plan made DTensors into DTensors replicated over tp (to
// meet the plan's DTensor activations), so a model without its TP plan
// fails at its first op. The core cannot tell that from the op, so the
// technique leaves its explanation here, as data (STYLE: a lower layer never
// learns about a higher one), for the duration of its module's forward; the
// error appends it and clears it (a forward that throws never reaches the
// post-hook that would restore the outer value; the next root forward
// clears it too). Nothing reads it on the per-op path.
//
// This thread's hint: a field of its DispatchContext (NOTE: [Dispatch
// context]), declared here so that the layer that sets it needs no more.
std::shared_ptr<const std::string>& mix_hint();

}  // namespace dtp::detail
