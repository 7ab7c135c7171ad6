// A test fixture over mesh shapes (2), (4) and (2,2): run() runs a body on
// every rank (threads, dist.h) with the mesh made; on() places on its last dim.
#pragma once

#include "dist.h"

#include "dtp/device_mesh.h"
#include "dtp/placement.h"

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

namespace dtp::test {

class MeshTest : public ::testing::TestWithParam<std::vector<int64_t>> {
 protected:
  void run(const std::function<void(const DeviceMesh&, int64_t w)>& body) {
    const auto shape = GetParam();
    int world = 1;
    for (auto s : shape) world *= static_cast<int>(s);
    run_ranks(world, [&](int) {
      auto mesh = init_device_mesh("cpu", shape);
      body(mesh, mesh.size(mesh.ndim() - 1));
    });
  }
  // The placement `p` on the last mesh dim, R elsewhere (or `other` there).
  static Placements on(const DeviceMesh& mesh, Placement p, Placement other = Replicate()) {
    Placements pl(mesh.ndim(), other);
    pl.back() = p;
    return pl;
  }
};

inline auto mesh_shapes() {
  return ::testing::Values(std::vector<int64_t>{2}, std::vector<int64_t>{4}, std::vector<int64_t>{2, 2});
}
inline std::string mesh_name(const ::testing::TestParamInfo<std::vector<int64_t>>& info) {
  std::string s = "mesh";
  for (auto d : info.param) s += "_" + std::to_string(d);
  return s;
}

}  // namespace dtp::test
