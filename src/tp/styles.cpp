// The ParallelStyles. Each checks its target, swaps parameters for DTensors
// and installs input/output hooks, naming the FQN in every error.
#include "dtp/tp/style.h"

#include "dtp/dtensor.h"
#include "dtp/module_utils.h"
#include "dtp/nn/hooked.h"
#include "tp/style_util.h"

#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

namespace dtp {
namespace tp_detail {

nn::HookHost& hooks_of(torch::nn::Module& m, const std::string& fqn, const std::string& style) {
  auto* host = dynamic_cast<nn::HookHost*>(&m);
  TORCH_CHECK(host != nullptr, style, ": the module at '", fqn, "' (", m.name(),
              ") cannot run hooks, which this style needs. Declare the field with dtp::nn::Linear "
              "/ dtp::nn::Embedding / ..., or wrap a custom module with DTP_MODULE instead of "
              "TORCH_MODULE.");
  host->fqn = fqn;
  return *host;
}

at::Tensor as_dtensor(at::Tensor t, const DeviceMesh& mesh, Placement layout, std::optional<int64_t> dim_size) {
  if (!t.defined() || is_dtensor(t)) return t;
  std::optional<std::vector<int64_t>> shape;
  if (layout.is_shard() && dim_size) {
    auto s = t.sizes().vec();
    s[c10::maybe_wrap_dim(layout.dim, t.dim())] = *dim_size;
    shape = s;
  }
  return from_local(t, mesh, {layout}, /*run_check=*/false, shape);
}

at::Tensor relayout(at::Tensor t, const DeviceMesh& mesh, Placement p, bool async_op) {
  return placements(t) == Placements{p} ? t : redistribute(std::move(t), mesh, {p}, async_op);
}

at::Tensor to_layout(at::Tensor t, const DeviceMesh& mesh, Placement p, bool use_local, bool async_op) {
  if (!t.defined()) return t;
  at::Tensor out = relayout(std::move(t), mesh, p, async_op);
  return use_local ? to_local(out) : out;
}

}  // namespace tp_detail

namespace {

using namespace tp_detail;

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

std::string expected(const std::string& style, const std::string& fqn, const torch::nn::Module& m) {
  return style + ": expected nn::Linear or nn::Embedding at '" + fqn + "', got " + m.name() + ".";
}

// The forward's first argument, which Colwise, Rowwise and SequenceParallel
// prepare (PyTorch's inputs[0]); an error when it is not a tensor.
at::Tensor& firstInput(nn::Slots& in, const std::string& style, const std::string& fqn) {
  TORCH_CHECK(!in.empty() && in.is_tensor(0), style, ": the forward of '", fqn, "' takes ",
              in.empty() ? "no arguments" : "a non-tensor first argument",
              "; this style prepares the first argument, which must be a tensor.");
  return in[0];
}

// Colwise's and Rowwise's output hook: the forward's one tensor output to
// `layout`, local when `use_local`. Async, as PyTorch's _prepare_output_fn
// (to_local then waits at once; PyTorch's returns the AsyncCollectiveTensor,
// which a plain at::Tensor cannot be).
nn::PostHook outputTo(const std::string& style, const std::string& fqn, const DeviceMesh& mesh, Placement layout,
                      bool use_local) {
  return [style, fqn, mesh, layout, use_local](nn::Slots& out) {
    TORCH_CHECK(out.size() == 1 && out.is_tensor(0), style, ": the forward of '", fqn, "' returns ", out.size(),
                " outputs; this style prepares one tensor output. Use PrepareModuleOutput with one layout per output.");
    out[0] = to_layout(std::move(out[0]), mesh, layout, use_local, /*async_op=*/true);
  };
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
  auto& host = hooks_of(m, fqn, name());
  const auto o = options_;
  // The input's redistribution is async, as PyTorch's _prepare_input_fn:
  // the forward's first op on it waits (NOTE: [Async redistribution]).
  host.pre_hooks.push_back([o, mesh, fqn, n = name()](nn::Slots& in) {
    at::Tensor& x = firstInput(in, n, fqn);
    x = relayout(as_dtensor(x, mesh, o.input_layouts()), mesh, Replicate(), /*async_op=*/true);
  });
  host.post_hooks.push_back(outputTo(name(), fqn, mesh, o.output_layouts(), o.use_local_output()));
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
  auto& host = hooks_of(m, fqn, name());
  host.pre_hooks.push_back([o, mesh, in_size, desired_input, fqn, n = name()](nn::Slots& in) {
    at::Tensor& x = firstInput(in, n, fqn);
    const bool last_dim = o.input_layouts().is_shard() && (o.input_layouts().dim == -1 ||
                                                           o.input_layouts().dim == x.dim() - 1);
    x = relayout(as_dtensor(x, mesh, o.input_layouts(), last_dim ? in_size : std::nullopt), mesh, desired_input,
                 /*async_op=*/true);
  });
  host.post_hooks.push_back(outputTo(name(), fqn, mesh, o.output_layouts(), o.use_local_output()));
}

void SequenceParallel::apply(torch::nn::Module& m, const std::string& fqn, const DeviceMesh& mesh,
                             std::optional<int> src) const {
  replicateParams(m, fqn, mesh, src);
  auto& host = hooks_of(m, fqn, name());
  const auto o = options_;
  // As PyTorch's: a plain input is this rank's sequence shard; a DTensor in
  // another layout (a Replicate embedding output, say) is redistributed.
  host.pre_hooks.push_back([o, mesh, fqn, n = name()](nn::Slots& in) {
    at::Tensor& x = firstInput(in, n, fqn);
    if (!x.defined()) return;
    const Placement seq = Shard(c10::maybe_wrap_dim(o.sequence_dim(), x.dim()));
    x = relayout(as_dtensor(x, mesh, seq), mesh, seq, /*async_op=*/true);
  });
  if (o.use_local_output()) {
    host.post_hooks.push_back([](nn::Slots& out) {
      for (auto& y : out)
        if (y.defined() && is_dtensor(y)) y = to_local(y);
    });
  }
}

}  // namespace dtp
