// Golden sharding-rule tests without communication: DTensors on a fake mesh
// (no process groups) written in compact text, and what the propagator
// decides for an op on them, also as text:
//
//   RuleGolden g({2});  // a 1-D mesh of 2, seen from coordinate 0
//   g.propagate("aten::mm", {g.t("f32[8,16](S(0))"), g.t("f32[16,4](R)")})
//       == "S(0), R -> f32[8,4](S(0))"
//
// Left of the arrow: the placements each DTensor input is redistributed to
// (equal to its own when nothing moves); right: the outputs' specs ("self"
// for in-place returns). A rejected call gives "error: <message>".
#pragma once

#include "dtensor/dispatch.h"
#include "dtensor/dtensor_impl.h"
#include "dtensor/sharding_prop.h"
#include "mesh/fake_mesh.h"

#include <ATen/ATen.h>

#include <cctype>
#include <string>
#include <vector>

namespace dtp::test {

class RuleGolden {
 public:
  explicit RuleGolden(std::vector<int64_t> mesh_shape, std::vector<int64_t> coordinate = {})
      : mesh_(make_fake_device_mesh(mesh_shape, coordinate.empty() ? std::vector<int64_t>(mesh_shape.size(), 0)
                                                                   : coordinate)) {
    ensure_dtensor_dispatch();
  }

  const DeviceMesh& mesh() const { return mesh_; }

  // A DTensor from "f32[8,16](S(0)R)": dtype, global shape, one placement
  // per mesh dim (S(d), R, P(sum), P(avg), P(max), P(min), MaskP(d,n)).
  at::Tensor t(const std::string& text) const {
    size_t i = text.find('[');
    const at::ScalarType dtype = dtypeOf(text.substr(0, i));
    std::vector<int64_t> shape;
    for (++i; text[i] != ']';) {
      if (text[i] == ',') ++i;
      size_t used = 0;
      shape.push_back(std::stoll(text.substr(i), &used));
      i += used;
    }
    i += 2;  // "]("
    Placements pl;
    while (pl.size() < static_cast<size_t>(mesh_.ndim())) {
      if (text[i] == 'R') {
        pl.push_back(Replicate());
        ++i;
      } else if (text[i] == 'S') {
        size_t used = 0;
        pl.push_back(Shard(std::stoll(text.substr(i + 2), &used)));
        i += 3 + used;
      } else if (text.compare(i, 6, "MaskP(") == 0) {  // MaskP(offset dim,offset size)
        size_t used = 0;
        const int64_t dim = std::stoll(text.substr(i + 6), &used);
        const size_t comma = i + 6 + used;
        const int64_t size = std::stoll(text.substr(comma + 1), &used);
        pl.push_back(MaskPartial(size, dim));
        i = comma + 1 + used + 1;
      } else if (text[i] == 'P') {
        const size_t close = text.find(')', i);
        const std::string op = text.substr(i + 2, close - i - 2);
        pl.push_back(Partial(op == "avg" ? ReduceOp::Avg : op == "max" ? ReduceOp::Max
                             : op == "min" ? ReduceOp::Min : ReduceOp::Sum));
        i = close + 1;
      } else {
        TORCH_CHECK(false, "RuleGolden: cannot read the placements of ", text);
      }
    }
    auto spec = make_spec(mesh_, pl, shape, dtype);
    return makeDTensor(at::zeros(spec->local_sizes, at::TensorOptions().dtype(dtype)), spec);
  }

  // The decision for `op` ("aten::mm", "aten::sum.dim_IntList") on `args`;
  // trailing arguments left out take the schema's defaults.
  std::string propagate(const std::string& op, std::vector<c10::IValue> args) const {
    const auto dot = op.find('.');
    auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(
        op.substr(0, dot).c_str(), dot == std::string::npos ? "" : op.substr(dot + 1).c_str());
    const auto& schema = handle.schema();
    for (size_t i = args.size(); i < schema.arguments().size(); ++i) {
      TORCH_CHECK(schema.arguments()[i].default_value().has_value(), "RuleGolden: ", op, " needs argument ",
                  schema.arguments()[i].name());
      args.push_back(*schema.arguments()[i].default_value());
    }
    OpCall call{handle, args, {}, {}, 0};
    fill_slots(call);  // as the fallback does
    try {
      const Decision& d = dtp::propagate(call);
      std::string s;
      for (size_t k = 0; k < d.in.size(); ++k) s += (k ? ", " : "") + to_string(d.in[k]);
      s += " ->";
      for (size_t k = 0; k < d.out.size(); ++k) s += (k ? ", " : " ") + (d.out[k] ? d.out[k]->str() : "self");
      return s;
    } catch (const c10::Error& e) {
      return "error: " + std::string(e.what_without_backtrace());
    }
  }

 private:
  static at::ScalarType dtypeOf(const std::string& name) {
    for (auto t : {at::kFloat, at::kDouble, at::kLong, at::kInt, at::kBool, at::kHalf, at::kBFloat16})
      if (short_dtype_name(t) == name) return t;
    TORCH_CHECK(false, "RuleGolden: unknown dtype ", name);
    return at::kFloat;
  }

  DeviceMesh mesh_;
};

}  // namespace dtp::test
