// A DeviceMesh without process groups, seen from one coordinate: for tests
// of sharding rules, which decide placements and shapes but never
// communicate. Any attempt to communicate on it is an error.
#pragma once

#include "dtp/device_mesh.h"

namespace dtp {

DeviceMesh make_fake_device_mesh(const std::vector<int64_t>& shape, const std::vector<int64_t>& coordinate,
                                 const std::vector<std::string>& names = {});

}  // namespace dtp
