// The ParallelStyles. Each checks its target, swaps parameters for DTensors
// and installs input/output hooks, naming the FQN in every error.
#include "dtp/tp/style.h"

#include "dtp/dtensor.h"
#include "dtp/module_utils.h"
#include "dtp/nn/hooked.h"

#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

namespace dtp {
namespace {

nn::HookHost& hooksOf(torch::nn::Module& m, const std::string& fqn, const std::string& style) {
  auto* host = dynamic_cast<nn::HookHost*>(&m);
  TORCH_CHECK(host != nullptr, style, ": the module at '", fqn, "' (", m.name(),
              ") cannot run hooks, which this style needs. Declare the field with dtp::nn::Linear "
              "/ dtp::nn::Embedding / ..., or wrap a custom module with DTP_MODULE instead of "
              "TORCH_MODULE.");
  host->fqn = fqn;
  return *host;
}

void shardParam(torch::nn::Module& m, const std::string& fqn, const std::string& name,
                const DeviceMesh& mesh, Placement p, std::optional<int> src) {
  auto params = m.named_parameters(/*recurse=*/false);
  const at::Tensor* t = params.find(name);
  if (t == nullptr || !t->defined()) return;  // e.g. Linear without bias
  if (is_dtensor(*t)) {
    // A weight tied to one parallelized before (parallelize.cpp keeps ties).
    if (device_mesh(*t) == mesh && placements(*t) == Placements{p}) return;
    TORCH_CHECK(false, "parallelize_module: parameter '", name, "' of '", fqn, "' is already a DTensor ",
                dtensor_spec(*t).str(), ", and this style wants ", to_string(Placements{p}),
                ". Each module can be parallelized once (check for overlapping plan entries); a weight "
                "tied to another module's must get the same placement from both (Rowwise Embedding "
                "and Colwise Linear both use Shard(0)).");
  }
  at::Tensor local = t->detach().requires_grad_(t->requires_grad());
  set_parameter(m, name, distribute_tensor(local, mesh, {p}, src));
}

void replicateParams(torch::nn::Module& m, const std::string& fqn, const DeviceMesh& mesh,
                     std::optional<int> src) {
  for (const auto& p : m.named_parameters(/*recurse=*/false))
    shardParam(m, fqn, p.key(), mesh, Replicate(), src);
}

// A forward argument as a DTensor: a plain tensor is this rank's shard of
// `layout`. `dim_size` gives the global size of a sharded dim when the module
// knows it (Rowwise Linear: in_features), so uneven shards stay exact; else
// shards are taken as even and from_local checks that.
at::Tensor asDTensor(at::Tensor t, const DeviceMesh& mesh, Placement layout,
                     std::optional<int64_t> dim_size = std::nullopt) {
  if (!t.defined() || is_dtensor(t)) return t;
  std::optional<std::vector<int64_t>> shape;
  if (layout.is_shard() && dim_size) {
    auto s = t.sizes().vec();
    s[c10::maybe_wrap_dim(layout.dim, t.dim())] = *dim_size;
    shape = s;
  }
  return from_local(t, mesh, {layout}, /*run_check=*/false, shape);
}

// Redistributes only when the layout differs (PyTorch's styles do the same): a
// redistribute to the same placements would be a gradient boundary.
// Takes `t` over: a module output nobody else holds is reduced in place.
at::Tensor relayout(at::Tensor t, const DeviceMesh& mesh, Placement p) {
  return placements(t) == Placements{p} ? t : redistribute(std::move(t), mesh, {p});
}

at::Tensor to(at::Tensor t, const DeviceMesh& mesh, Placement p, bool use_local) {
  if (!t.defined()) return t;
  at::Tensor out = relayout(std::move(t), mesh, p);
  return use_local ? to_local(out) : out;
}

std::string expected(const std::string& style, const std::string& fqn, const torch::nn::Module& m) {
  return style + ": expected nn::Linear or nn::Embedding at '" + fqn + "', got " + m.name() + ".";
}

}  // namespace

void ColwiseParallel::apply(torch::nn::Module& m, const std::string& fqn, const DeviceMesh& mesh,
                            std::optional<int> src) const {
  if (dynamic_cast<torch::nn::LinearImpl*>(&m)) {
    shardParam(m, fqn, "weight", mesh, Shard(0), src);
    shardParam(m, fqn, "bias", mesh, Shard(0), src);
  } else if (dynamic_cast<torch::nn::EmbeddingImpl*>(&m)) {
    shardParam(m, fqn, "weight", mesh, Shard(1), src);
  } else {
    TORCH_CHECK(false, expected(name(), fqn, m));
  }
  auto& host = hooksOf(m, fqn, name());
  const auto o = options_;
  host.pre_hooks.push_back([o, mesh](std::vector<at::Tensor>& in) {
    in[0] = relayout(asDTensor(in[0], mesh, o.input_layouts()), mesh, Replicate());
  });
  host.post_hooks.push_back([o, mesh](at::Tensor& out) {
    out = to(std::move(out), mesh, o.output_layouts(), o.use_local_output());
  });
}

void RowwiseParallel::apply(torch::nn::Module& m, const std::string& fqn, const DeviceMesh& mesh,
                            std::optional<int> src) const {
  const auto o = options_;
  std::optional<int64_t> in_size;
  Placement desired_input;
  if (auto* lin = dynamic_cast<torch::nn::LinearImpl*>(&m)) {
    in_size = lin->options.in_features();
    desired_input = Shard(-1);
    shardParam(m, fqn, "weight", mesh, Shard(1), src);
    shardParam(m, fqn, "bias", mesh, Replicate(), src);
  } else if (dynamic_cast<torch::nn::EmbeddingImpl*>(&m)) {
    desired_input = Replicate();
    shardParam(m, fqn, "weight", mesh, Shard(0), src);
  } else {
    TORCH_CHECK(false, expected(name(), fqn, m));
  }
  auto& host = hooksOf(m, fqn, name());
  host.pre_hooks.push_back([o, mesh, in_size, desired_input](std::vector<at::Tensor>& in) {
    const bool last_dim = o.input_layouts().is_shard() && (o.input_layouts().dim == -1 ||
                                                           o.input_layouts().dim == in[0].dim() - 1);
    in[0] = relayout(asDTensor(in[0], mesh, o.input_layouts(), last_dim ? in_size : std::nullopt), mesh,
                     desired_input);
  });
  host.post_hooks.push_back([o, mesh](at::Tensor& out) {
    out = to(std::move(out), mesh, o.output_layouts(), o.use_local_output());
  });
}

void SequenceParallel::apply(torch::nn::Module& m, const std::string& fqn, const DeviceMesh& mesh,
                             std::optional<int> src) const {
  replicateParams(m, fqn, mesh, src);
  auto& host = hooksOf(m, fqn, name());
  const auto o = options_;
  host.pre_hooks.push_back([o, mesh](std::vector<at::Tensor>& in) {
    in[0] = asDTensor(in[0], mesh, Shard(o.sequence_dim()));
  });
  if (o.use_local_output()) {
    host.post_hooks.push_back([](at::Tensor& out) {
      if (is_dtensor(out)) out = to_local(out);
    });
  }
}

void PrepareModuleInput::apply(torch::nn::Module& m, const std::string& fqn, const DeviceMesh& mesh,
                               std::optional<int>) const {
  const auto o = options_;
  TORCH_CHECK(o.input_layouts().size() == o.desired_input_layouts().size(), name(), " at '", fqn,
              "': got ", o.input_layouts().size(), " input_layouts but ",
              o.desired_input_layouts().size(),
              " desired_input_layouts. Give one entry per tensor argument in both (nullopt to "
              "skip one).");
  for (size_t i = 0; i < o.input_layouts().size(); ++i) {
    TORCH_CHECK(o.input_layouts()[i].has_value() == o.desired_input_layouts()[i].has_value(),
                name(), " at '", fqn, "': tensor argument ", i,
                " has an input layout but no desired layout, or the reverse. Give both or neither.");
  }
  auto& host = hooksOf(m, fqn, name());
  host.pre_hooks.push_back([o, mesh, fqn, n = name()](std::vector<at::Tensor>& in) {
    TORCH_CHECK(in.size() >= o.input_layouts().size(), n, " at '", fqn, "': forward got ",
                in.size(), " tensor arguments, but input_layouts has ", o.input_layouts().size(),
                " entries.");
    for (size_t i = 0; i < o.input_layouts().size(); ++i) {
      if (!o.input_layouts()[i]) continue;
      at::Tensor x = asDTensor(in[i], mesh, *o.input_layouts()[i]);
      if (o.gradient_boundary()) x = redistribute(std::move(x), mesh, {*o.desired_input_layouts()[i]});
      in[i] = to(std::move(x), mesh, *o.desired_input_layouts()[i], o.use_local_output());
    }
  });
}

void PrepareModuleOutput::apply(torch::nn::Module& m, const std::string& fqn, const DeviceMesh& mesh,
                                std::optional<int>) const {
  const auto o = options_;
  auto& host = hooksOf(m, fqn, name());
  host.post_hooks.push_back([o, mesh](at::Tensor& out) {
    out = to(asDTensor(std::move(out), mesh, o.output_layouts()), mesh, o.desired_output_layouts(),
             o.use_local_output());
  });
}

void PrepareModuleInputOutput::apply(torch::nn::Module& m, const std::string& fqn,
                                     const DeviceMesh& mesh, std::optional<int> src) const {
  in_.apply(m, fqn, mesh, src);
  out_.apply(m, fqn, mesh, src);
}

}  // namespace dtp
