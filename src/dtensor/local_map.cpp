#include "dtp/local_map.h"

#include "dtp/dtensor.h"

#include <c10/util/Exception.h>

namespace dtp {

LocalMapFn local_map(LocalMapFn fn, std::vector<std::optional<Placements>> out_placements,
                     std::vector<std::optional<Placements>> in_placements,
                     std::vector<std::optional<Placements>> in_grad_placements, LocalMapOptions options) {
  TORCH_CHECK(fn != nullptr, "local_map: the function is empty.");
  return [fn = std::move(fn), out_placements = std::move(out_placements), in_placements = std::move(in_placements),
          in_grad_placements = std::move(in_grad_placements),
          options = std::move(options)](const std::vector<at::Tensor>& inputs) {
    const size_t n = inputs.size();
    TORCH_CHECK(in_placements.empty() || in_placements.size() == n, "local_map: ", in_placements.size(),
                " in_placements for ", n, " inputs. Give one per input (nullopt for plain ones), or none.");
    TORCH_CHECK(in_grad_placements.empty() || in_grad_placements.size() == n, "local_map: ",
                in_grad_placements.size(), " in_grad_placements for ", n, " inputs. Give one per input, or none.");
    std::optional<DeviceMesh> mesh = options.device_mesh();
    bool any_dtensor = false;
    std::vector<at::Tensor> local;
    for (size_t i = 0; i < n; ++i) {
      at::Tensor t = inputs[i];
      if (!t.defined() || !is_dtensor(t)) {
        local.push_back(t);
        continue;
      }
      any_dtensor = true;
      if (!mesh) mesh = device_mesh(t);
      TORCH_CHECK(device_mesh(t) == *mesh, "local_map: input ", i, " ", dtensor_spec(t).str(), " is on ",
                  device_mesh(t).str(), ", but the outputs' mesh is ", mesh->str(),
                  ". Redistribute it onto that mesh first.");
      if (!in_placements.empty()) {
        TORCH_CHECK(in_placements[i].has_value(), "local_map: input ", i, " is a DTensor ",
                    dtensor_spec(t).str(), " but in_placements[", i, "] is nullopt. Give the placements "
                    "the function expects for it.");
        const Placements& want = *in_placements[i];
        if (placements(t) != want) {
          TORCH_CHECK(options.redistribute_inputs(), "local_map: input ", i, " is ", dtensor_spec(t).str(),
                      ", but in_placements[", i, "] is ", to_string(want), ". Redistribute it first, or pass "
                      "LocalMapOptions().redistribute_inputs(true).");
          t = redistribute(t, *mesh, want);
        }
      }
      std::optional<Placements> grad;
      if (!in_grad_placements.empty()) grad = in_grad_placements[i];
      local.push_back(to_local(t, grad));
    }
    std::vector<at::Tensor> out = fn(any_dtensor ? local : inputs);
    if (!any_dtensor) return out;
    TORCH_CHECK(out.size() == out_placements.size(), "local_map: the function returned ", out.size(),
                " tensors, but out_placements has ", out_placements.size(), ". Give one per output (nullopt "
                "to return it as a plain tensor).");
    const auto& shapes = options.out_shapes();
    TORCH_CHECK(shapes.empty() || shapes.size() == out.size(), "local_map: ", shapes.size(), " out_shapes for ",
                out.size(), " outputs. Give one per output (nullopt: even shards), or none.");
    for (size_t o = 0; o < out.size(); ++o) {
      if (!out_placements[o]) continue;
      TORCH_CHECK(out[o].defined() && !is_dtensor(out[o]), "local_map: output ", o, " of the function is ",
                  out[o].defined() ? dtensor_spec(out[o]).str() : std::string("undefined"),
                  "; it must return plain (local) tensors.");
      out[o] = from_local(out[o], *mesh, *out_placements[o], /*run_check=*/false,
                          shapes.empty() ? std::nullopt : shapes[o]);
    }
    return out;
  };
}

}  // namespace dtp
