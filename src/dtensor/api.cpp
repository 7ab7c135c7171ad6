// The DTensor API: distribute_tensor, from_local, to_local, full_tensor,
// redistribute, and their autograd nodes.
#include "dtp/dtensor.h"

#include "dtensor/dispatch.h"
#include "dtensor/dtensor_impl.h"
#include "dtensor/redistribute.h"
#include "dtensor/spec_facts.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

namespace dtp {
namespace {

using torch::autograd::variable_list;

// Backward of a redistribution (also of from_local, whose input is a plain
// shard): the gradient goes back to the source placements, with a Partial
// source receiving a Replicate gradient. A MaskPartial source's gradient is
// replicated too, and keeps the source's MaskPartial placement and mask
// (NOTE: [MaskPartial]): every position holds the value on every rank, so
// its owner's does, and the embedding's backward reads from it that only
// this rank's rows are needed.
struct RedistributeBackward : torch::autograd::Node {
  SpecPtr src;       // forward input spec
  bool to_plain;     // from_local: return the plain local gradient
  std::string name() const override {
    return to_plain ? "dtp::FromLocalBackward" : "dtp::RedistributeBackward";
  }
  variable_list apply(variable_list&& grads) override {
    const at::Tensor& g = grads[0];
    if (!g.defined()) return {at::Tensor()};
    auto* gi = maybeGetDTensorImpl(g);
    TORCH_INTERNAL_ASSERT(gi != nullptr, name(), ": gradient is not a DTensor");
    Placements target = src->placements;
    bool mask_partial = false;
    if (!to_plain) {
      for (auto& p : target) {
        mask_partial |= p.is_mask_partial();
        if (p.is_partial() || p.is_mask_partial()) p = Replicate();
      }
    }
    // The engine hands over its gradient buffer: unless a hook kept it, a
    // Partial is reduced in place.
    at::Tensor local = redistribute_local(gi->local(), gi->spec(), target, /*backward=*/true, solely_owned(g));
    if (to_plain) return {local};
    if (mask_partial) {
      Placements grad = target;
      for (size_t m = 0; m < grad.size(); ++m)
        if (src->placements[m].is_mask_partial()) grad[m] = src->placements[m];
      return {makeDTensor(local, with_facts(make_spec(src->mesh, grad, src->shape, gi->spec().dtype), src->facts))};
    }
    return {makeDTensor(local, make_spec(src->mesh, target, src->shape, gi->spec().dtype))};
  }
};

// Backward of to_local: the plain gradient becomes a DTensor again.
struct ToLocalBackward : torch::autograd::Node {
  SpecPtr grad_spec;
  std::string name() const override { return "dtp::ToLocalBackward"; }
  variable_list apply(variable_list&& grads) override {
    const at::Tensor& g = grads[0];
    if (!g.defined()) return {at::Tensor()};
    TORCH_CHECK(g.sizes() == c10::IntArrayRef(grad_spec->local_sizes),
                "to_local backward: the gradient of the local shard has shape ", g.sizes(),
                ", but grad_placements ", to_string(grad_spec->placements), " of ",
                grad_spec->str(), " need ", c10::IntArrayRef(grad_spec->local_sizes),
                " on this rank. Pass grad_placements that match the gradient.");
    auto spec = grad_spec->dtype == g.scalar_type()
                    ? grad_spec
                    : make_spec(grad_spec->mesh, grad_spec->placements, grad_spec->shape,
                                g.scalar_type());
    return {makeDTensor(g, spec)};
  }
};

// Gives `out` the backward node make_node() makes when `input` records a
// graph; with no graph to record (decode, no_grad) no node is made.
template <class MakeNode>
at::Tensor connect(at::Tensor out, const at::Tensor& input, MakeNode make_node) {
  if (input.requires_grad() && at::GradMode::is_enabled()) {
    auto node = make_node();
    node->set_next_edges(torch::autograd::collect_next_edges(input));
    torch::autograd::set_history(out, node);
  }
  return out;
}

// NOTE: [MaskPartial]: only an op knows a MaskPartial's mask.
void checkNoMaskPartial(const Placements& placements, const char* fn) {
  for (const auto& p : placements) {
    TORCH_CHECK(!p.is_mask_partial(), fn, ": NYI: ", p.str(), " in ", to_string(placements),
                ": a MaskPartial is made by an op that knows its mask (the embedding of a vocabulary-sharded "
                "weight). Use Partial() for a partial sum.");
  }
}

}  // namespace

bool is_dtensor(const at::Tensor& t) { return isDTensor(t); }
const DTensorSpec& dtensor_spec(const at::Tensor& t) { return checkedDTensorImpl(t, "dtensor_spec").spec(); }
const Placements& placements(const at::Tensor& t) { return checkedDTensorImpl(t, "placements").spec().placements; }
const DeviceMesh& device_mesh(const at::Tensor& t) { return checkedDTensorImpl(t, "device_mesh").spec().mesh; }

at::Tensor distribute_tensor(const at::Tensor& tensor, const DeviceMesh& mesh,
                             const Placements& placements, std::optional<int> src_data_rank) {
  ensure_dtensor_dispatch();
  TORCH_CHECK(!isDTensor(tensor), "distribute_tensor: the tensor is already a DTensor ",
              dtensor_spec(tensor).str(), ". Use dtp::redistribute to change its placements.");
  checkNoMaskPartial(placements, "distribute_tensor");
  auto spec = make_spec(mesh, placements, tensor.sizes().vec(), tensor.scalar_type());
  if (tensor.is_meta()) {
    // A meta tensor has no values to send: the result is this rank's shard,
    // allocated on the mesh's device and not initialized, for an init pass
    // afterwards (NOTE: [Deferred initialization] in src/models/llama.cpp).
    at::Tensor out = makeDTensor(at::empty(spec->local_sizes, tensor.options().device(mesh.device())), spec);
    if (tensor.requires_grad()) {
      out.set_requires_grad(true);
      keep_grad_placements(out);
    }
    return out;
  }
  at::Tensor t = tensor.detach();
  const auto coord = mesh.get_coordinate();
  for (size_t m = 0; m < spec->placements.size(); ++m) {
    const Placement& p = spec->placements[m];
    const int64_t n = mesh.size(m);
    if (src_data_rank) {
      TORCH_CHECK(*src_data_rank >= 0 && *src_data_rank < n, "distribute_tensor: src_data_rank ",
                  *src_data_rank, " is not a coordinate of mesh dim ", m, " of ", mesh.str(),
                  ". Use 0..", n - 1, " or std::nullopt.");
    }
    if (p.is_shard()) {
      const int64_t d = p.dim, size = t.size(d);
      if (src_data_rank) {
        std::vector<at::Tensor> chunks;
        if (coord[m] == *src_data_rank) {
          for (int64_t k = 0; k < n; ++k)
            chunks.push_back(t.narrow(d, chunk_start(size, n, k), chunk_size(size, n, k)));
        }
        auto shape = t.sizes().vec();
        shape[d] = chunk_size(size, n, coord[m]);
        at::Tensor out = at::empty(shape, t.options());
        mesh.get_group(m).scatter(out, chunks, *src_data_rank);
        t = out;
      } else {
        t = t.narrow(d, chunk_start(size, n, coord[m]), chunk_size(size, n, coord[m]));
      }
    } else {
      if (src_data_rank) {
        t = t.clone();
        mesh.get_group(m).broadcast(t, *src_data_rank);
      }
      if (p.is_partial() && p.op == ReduceOp::Sum && coord[m] != 0) t = at::zeros_like(t);
    }
  }
  // As PyTorch's: a tensor on another device type than the mesh's moves to
  // the mesh's device (a model built on the CPU, parallelized on a cuda mesh).
  if (t.device().type() != mesh.device().type()) t = t.to(mesh.device());
  at::Tensor out = makeDTensor(t.contiguous(), spec);
  if (tensor.requires_grad()) {
    out.set_requires_grad(true);
    keep_grad_placements(out);
  }
  return out;
}

at::Tensor from_local(const at::Tensor& local, const DeviceMesh& mesh, const Placements& placements,
                      bool run_check, std::optional<std::vector<int64_t>> shape) {
  ensure_dtensor_dispatch();
  TORCH_CHECK(!isDTensor(local), "from_local: the tensor is already a DTensor ",
              dtensor_spec(local).str(), ". Pass its to_local() shard.");
  checkNoMaskPartial(placements, "from_local");
  std::vector<int64_t> global = local.sizes().vec();
  if (shape) {
    global = *shape;
  } else {
    for (size_t m = 0; m < placements.size(); ++m) {
      if (!placements[m].is_shard()) continue;
      TORCH_CHECK(local.dim() > 0, "from_local: a scalar (0-d) tensor cannot be sharded: mesh dim ", m,
                  " says Shard(", placements[m].dim, "). Use Replicate or Partial, or give the tensor a dimension.");
      int64_t d = c10::maybe_wrap_dim(placements[m].dim, local.dim());
      global[d] *= mesh.size(static_cast<int64_t>(m));
    }
  }
  auto spec = make_spec(mesh, placements, global, local.scalar_type());
  if (run_check) {
    // Every rank's shard shape must match the global shape, per mesh dim.
    for (int64_t m = 0; m < mesh.ndim(); ++m) {
      const int64_t n = mesh.size(m);
      at::Tensor mine = at::tensor(local.sizes().vec(), at::kLong);
      at::Tensor all = mesh.get_group(m).all_gather(mine.unsqueeze(0), 0, std::vector<int64_t>(n, 1)).wait();
      auto coord = mesh.get_coordinate();
      for (int64_t k = 0; k < n; ++k) {
        coord[m] = k;
        auto expect = spec->local_shape(coord);
        auto got = std::vector<int64_t>(all[k].data_ptr<int64_t>(), all[k].data_ptr<int64_t>() + local.dim());
        TORCH_CHECK(got == expect, "from_local: the rank at coordinate ", k, " of mesh dim ", m,
                    " holds a shard of shape ", c10::IntArrayRef(got), ", but ", spec->str(),
                    " on ", mesh.str(), " puts a shard of shape ", c10::IntArrayRef(expect),
                    " there. Pass the global shape= explicitly for uneven shards.");
      }
    }
    // As PyTorch: a Replicate dim takes the data of its first rank, in place,
    // so that ranks that were handed different values agree from here on.
    at::AutoGradMode no_grad(false);
    at::Tensor data = local.detach();
    for (int64_t m = 0; m < mesh.ndim(); ++m)
      if (placements[m].is_replicate()) mesh.get_group(m).broadcast(data, 0);
  }
  TORCH_CHECK(local.sizes() == c10::IntArrayRef(spec->local_sizes), "from_local: local shard ",
              local.sizes(), " does not match ", spec->str(), ", which puts ",
              c10::IntArrayRef(spec->local_sizes), " on this rank. Pass the global shape=.");
  at::Tensor out = makeDTensor(detached_alias(local), spec);
  return connect(out, local, [&] {
    auto node = std::make_shared<RedistributeBackward>();
    node->src = spec;
    node->to_plain = true;
    return node;
  });
}

at::Tensor to_local(const at::Tensor& t, std::optional<Placements> grad_placements) {
  const auto& impl = checkedDTensorImpl(t, "to_local");
  at::Tensor out = detached_alias(impl.local());
  // Built even without a graph: a wrong grad_placements is an error at the call.
  SpecPtr grad_spec = grad_placements
                          ? make_spec(impl.spec().mesh, *grad_placements, impl.spec().shape, impl.spec().dtype)
                          : impl.spec_ptr();
  return connect(out, t, [&] {
    auto node = std::make_shared<ToLocalBackward>();
    node->grad_spec = std::move(grad_spec);
    return node;
  });
}

namespace {

at::Tensor redistributeImpl(const at::Tensor& t, const DeviceMesh& mesh, const Placements& placements,
                            bool consume, bool async_op) {
  const auto& impl = checkedDTensorImpl(t, "redistribute");
  TORCH_CHECK(mesh == impl.spec().mesh, "redistribute: the tensor lives on ",
              impl.spec().mesh.str(), ", not on ", mesh.str(),
              ". Redistribution across meshes is NYI.");
  auto spec = make_spec(mesh, placements, impl.spec().shape, impl.spec().dtype);
  at::Tensor out;
  if (spec->placements == impl.spec().placements) {
    // Still a gradient boundary, as in PyTorch: a Partial gradient arriving
    // here leaves as the source's placements (Replicate gets an all-reduce).
    if (!t.requires_grad() || !at::GradMode::is_enabled()) return t;
    out = makeDTensor(impl.local(), impl.spec_ptr());
  } else if (async_op && !SyncRedistributeScope::active()) {  // NOTE: [Async redistribution]
    const RedistributePlan& plan = cached_plan(impl.spec(), spec->placements);
    if (auto pending = run_redistribute_async(impl.local(), impl.spec_ptr(), plan, consume)) {
      out = makeDTensor(std::move(pending), spec);
    } else {
      out = makeDTensor(run_redistribute(impl.local(), impl.spec(), plan, /*backward=*/false, consume), spec);
    }
  } else {
    out = makeDTensor(redistribute_local(impl.local(), impl.spec(), spec->placements, /*backward=*/false, consume), spec);
  }
  return connect(out, t, [&] {
    auto node = std::make_shared<RedistributeBackward>();
    node->src = impl.spec_ptr();
    node->to_plain = false;
    return node;
  });
}

}  // namespace

at::Tensor redistribute(const at::Tensor& t, const DeviceMesh& mesh, const Placements& placements,
                        bool async_op) {
  return redistributeImpl(t, mesh, placements, /*consume=*/false, async_op);
}

at::Tensor redistribute(at::Tensor&& t, const DeviceMesh& mesh, const Placements& placements,
                        bool async_op) {
  return redistributeImpl(t, mesh, placements, solely_owned(t), async_op);
}

at::Tensor full_tensor(const at::Tensor& t) {
  const auto& impl = checkedDTensorImpl(t, "full_tensor");
  const auto& spec = impl.spec();
  return to_local(redistribute(t, spec.mesh, Placements(spec.placements.size(), Replicate())));
}

}  // namespace dtp
