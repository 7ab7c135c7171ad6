#include "dtp/local_map.h"

#include "dtp/dtensor.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <memory>
#include <mutex>
#include <string>
#include <utility>

namespace dtp {
namespace {

// NOTE: [Uneven local_map outputs] Without out_shapes, output o is wrapped
// by from_local assuming even shards: its global size along a sharded dim is
// the local size times the ranks. Shards of 3 and 2 rows then make rank 0
// see 6 rows and rank 1 see 4, and the first collective on it failed far
// from here or computed garbage. So the first call for each set of inputs
// (their global shapes and placements, the same on every rank) checks the
// sharded outputs: one all_gather of their local sizes per mesh dimension
// that shards one; the same inputs again cost nothing but this lookup. Per
// mesh (held, so its id is not reused): ranks run as threads sharing one
// function have meshes of their own groups, and check alike.
struct EvenChecked {
  std::mutex mu;
  std::vector<std::pair<DeviceMesh, std::string>> seen;
};

std::string inputsSignature(const std::vector<at::Tensor>& inputs) {
  std::string sig;
  for (const auto& t : inputs) {
    if (!t.defined()) sig += "-;";
    else if (is_dtensor(t)) sig += dtensor_spec(t).str() + ";";
    else sig += c10::str(t.sizes()) + ";";
  }
  return sig;
}

void checkEvenOutputs(const std::vector<at::Tensor>& out, const std::vector<std::optional<Placements>>& out_placements,
                      const DeviceMesh& mesh) {
  const int64_t ndim = mesh.ndim();
  for (int64_t m = 0; m < ndim; ++m) {
    std::vector<std::pair<size_t, int64_t>> which;  // (output, tensor dim) sharded over mesh dim m
    std::vector<int64_t> sizes;
    for (size_t o = 0; o < out.size(); ++o) {
      if (!out_placements[o] || !out[o].defined()) continue;
      const Placement p = (*out_placements[o])[m];
      if (!p.is_shard()) continue;
      const int64_t d = p.dim < 0 ? p.dim + out[o].dim() : p.dim;
      if (d < 0 || d >= out[o].dim()) continue;  // from_local names it
      which.emplace_back(o, d);
      sizes.push_back(out[o].size(d));
    }
    const ProcessGroup group = mesh.get_group(m);
    if (which.empty() || !group.valid() || group.size() <= 1) continue;
    const int64_t w = group.size(), k = static_cast<int64_t>(sizes.size());
    const at::Tensor all = group.all_gather(at::tensor(sizes, at::kLong), 0, std::vector<int64_t>(w, k)).wait().contiguous();
    const int64_t* v = all.data_ptr<int64_t>();
    for (int64_t i = 0; i < k; ++i) {
      bool even = true;
      std::string each;
      for (int64_t r = 0; r < w; ++r) {
        even &= v[r * k + i] == v[i];
        each += (r ? ", " : "") + std::to_string(v[r * k + i]);
      }
      const auto [o, d] = which[i];
      const auto& names = mesh.mesh_dim_names();
      TORCH_CHECK(even, "local_map: output ", o, " is ", to_string(*out_placements[o]), " with uneven shards along dim ",
                  d, " over mesh dimension ", m < static_cast<int64_t>(names.size()) ? "'" + names[m] + "'" :
                  std::to_string(m), " of ", mesh.str(), ": got local sizes ", each, " on its ranks, expected equal "
                  "ones (without out_shapes the global size is taken as the local size times ", w, ", and the ranks "
                  "would disagree on it). Pass LocalMapOptions().out_shapes with output ", o, "'s global shape.");
    }
  }
}

}  // namespace

LocalMapFn local_map(LocalMapFn fn, std::vector<std::optional<Placements>> out_placements,
                     std::vector<std::optional<Placements>> in_placements,
                     std::vector<std::optional<Placements>> in_grad_placements, LocalMapOptions options) {
  TORCH_CHECK(fn != nullptr, "local_map: the function is empty.");
  auto checked = std::make_shared<EvenChecked>();  // NOTE: [Uneven local_map outputs]
  return [fn = std::move(fn), out_placements = std::move(out_placements), in_placements = std::move(in_placements),
          in_grad_placements = std::move(in_grad_placements), options = std::move(options),
          checked](const std::vector<at::Tensor>& inputs) {
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
    bool sharded = false;
    for (size_t o = 0; o < out.size(); ++o) {
      if (!out_placements[o]) continue;
      TORCH_CHECK(out[o].defined() && !is_dtensor(out[o]), "local_map: output ", o, " of the function is ",
                  out[o].defined() ? dtensor_spec(out[o]).str() : std::string("undefined"),
                  "; it must return plain (local) tensors.");
      if (!shapes.empty() && shapes[o]) continue;
      for (const auto& p : *out_placements[o]) sharded |= p.is_shard();
    }
    if (sharded) {
      const std::string sig = inputsSignature(inputs);
      bool seen = false;
      {
        std::lock_guard<std::mutex> lock(checked->mu);
        for (const auto& [m, s] : checked->seen) seen |= s == sig && (m.id() == mesh->id() || m == *mesh);
      }
      if (!seen) {
        checkEvenOutputs(out, out_placements, *mesh);
        std::lock_guard<std::mutex> lock(checked->mu);
        checked->seen.emplace_back(*mesh, sig);
      }
    }
    for (size_t o = 0; o < out.size(); ++o) {
      if (!out_placements[o]) continue;
      out[o] = from_local(out[o], *mesh, *out_placements[o], /*run_check=*/false,
                          shapes.empty() ? std::nullopt : shapes[o]);
    }
    return out;
  };
}

}  // namespace dtp
