// loss_parallel: log_softmax and nll_loss on class-sharded logits, computed
// from the local columns and row statistics instead of gathering the logits.
// The sharding behaviour of the technique, registered into the core's rule
// registry by the first LossParallelGuard (NOTE: [loss_parallel's handlers]
// in loss_parallel_rules.h); the public face is include/dtp/tp/loss_parallel.h.
//
// Forward (under the guard), per class-sharded mesh dim:
//   _log_softmax:     all_reduce(max) of row maxima, all_reduce(sum) of
//                     row sums of exp -> log-probabilities stay class-sharded;
//   nll_loss_forward: all_reduce(sum) of the target's log-probability, which
//                     lives on one rank per row.
// Backward (guard or not):
//   nll_loss_backward:           the usual sparse gradient, on local columns;
//   _log_softmax_backward_data:  g - exp(out) * rowsum(g). The row sums of the
//     gradient nll_loss_backward made are known on every rank without
//     communication (-weight[target] * grad_out) and ride in its spec (NOTE:
//     [nll_loss gradient's row sums]), so that case moves nothing; any other
//     gradient (label smoothing adds one) all-reduces its row sums.
// loss_parallel_cross_entropy on 2-D logits does the same in one autograd
// node (loss_parallel.cpp), from the pieces loss_parallel_rules.h shares.
#include "tp/loss_parallel_rules.h"

#include "dtensor/dtensor_impl.h"
#include "dtensor/redistribute.h"
#include "dtensor/rule_registry.h"
#include "dtensor/spec_facts.h"

#include <ATen/ATen.h>
#include <c10/util/accumulate.h>

#include <limits>
#include <mutex>

namespace dtp::detail {
namespace {

thread_local bool loss_parallel_on = false;  // inside a LossParallelGuard on this thread

enum Reduction { kNone = 0, kMean = 1, kSum = 2 };  // at::Reduction's

// NOTE: [nll_loss gradient's row sums]
// nll_loss_backward's gradient on class-sharded log-probabilities is zero
// but at each row's target column, where it is -weight[target] * grad_out:
// every rank knows its row sums (the negated coefficients) without
// communication. The gradient's spec carries them (SpecFacts::dim_sums,
// NOTE: [Facts in specs]) to _log_softmax_backward_data, through the view
// nll_loss_nd puts between the two on [N, C, d] logits; the version of the
// shard is recorded, so a hook that changed the gradient in place makes
// log_softmax's backward sum it again.
std::shared_ptr<const SpecFacts> rowSumFacts(const at::Tensor& grad, int64_t class_dim, at::Tensor rowsum) {
  auto f = std::make_shared<SpecFacts>();
  f->dim_sums = std::move(rowsum);  // rows in the order of movedim(class_dim, -1)
  f->sum_dim = class_dim;
  f->rows_before = c10::multiply_integers(grad.sizes().slice(0, class_dim));
  f->rows_after = c10::multiply_integers(grad.sizes().slice(class_dim + 1));
  f->version = grad._version();
  return f;
}

// The row sums of `g` (this rank's shard of a gradient whose spec is
// `spec`) along `dim`, shaped as g.sum(dim, keepdim), if its maker left
// them and they still fit (same rows around the class dim, unmodified).
at::Tensor knownRowSums(const DTensorSpec& spec, const at::Tensor& g, int64_t dim) {
  const SpecFacts* f = spec.facts.get();
  if (f == nullptr || !f->dim_sums.defined() || f->version != g._version()) return {};
  if (c10::multiply_integers(g.sizes().slice(0, dim)) != f->rows_before ||
      c10::multiply_integers(g.sizes().slice(dim + 1)) != f->rows_after) {
    return {};
  }
  auto shape = g.sizes().vec();
  shape[dim] = 1;
  return f->dim_sums.reshape(shape);
}

// A mesh dim of one rank shards nothing: the class dim is whole there, and
// the op's own fused kernel (under its ordinary rule) serves it.
std::optional<ClassSharding> classSharding(const DTensorSpec& s, int64_t class_dim) {
  ClassSharding cs;
  for (size_t m = 0; m < s.placements.size(); ++m) {
    const Placement& p = s.placements[m];
    if (p.is_shard() && p.dim == class_dim) {
      if (s.mesh.size(static_cast<int64_t>(m)) > 1) cs.class_dims.push_back(m);
    } else if (p.is_shard() && p.dim == 0 && class_dim == 1) {
      cs.batch_dims.push_back(m);
    } else if (!p.is_replicate()) {
      return std::nullopt;
    }
    cs.rows.push_back(p.is_shard() && p.dim == 0 && class_dim == 1 ? Shard(0) : Replicate());
  }
  if (cs.class_dims.empty()) return std::nullopt;
  return cs;
}

// As PyTorch's loss_parallel: logits sharded, but not on the class dim (on
// any mesh dim, even of one rank), are refused. [S(0)] 2-D logits on a 1-D
// mesh are an error; [S(0), S(1)] on (dp, tp) with tp = 1 is not.
void checkShardedOnClassDim(const DTensorSpec& s, int64_t class_dim) {
  bool sharded = false, on_class = false;
  for (const auto& p : s.placements) {
    sharded |= p.is_shard();
    on_class |= p.is_shard() && p.dim == class_dim;
  }
  TORCH_CHECK(!sharded || on_class, "loss_parallel: expected logits sharded on the class dim ", class_dim,
              ", got ", s.str(), ". Shard the logits on the class dim (ColwiseParallel on the output projection, "
              "output_layouts(Shard(-1))), or compute the loss outside dtp::LossParallelGuard.");
}

void allReduce(const DTensorSpec& s, const std::vector<size_t>& dims, at::Tensor& t, ReduceOp op) {
  for (size_t m : dims) s.mesh.get_group(m).all_reduce(t, op);
}

// This rank's part of a per-row argument laid out as `want`: a DTensor is
// redistributed, a plain tensor is taken as the replicated whole.
at::Tensor localAs(const at::Tensor& t, const DeviceMesh& mesh, const Placements& want) {
  if (auto* impl = maybeGetDTensorImpl(t)) return redistribute_local(impl->local(), impl->spec(), want);
  if (t.dim() == 0) return t;
  auto whole = make_spec(mesh, Placements(want.size(), Replicate()), t.sizes().vec(), t.scalar_type());
  return redistribute_local(t, *whole, want);
}

at::Tensor wrap(at::Tensor local, const DTensorSpec& like, Placements placements, std::vector<int64_t> shape) {
  auto dtype = local.scalar_type();
  return makeDTensor(std::move(local), make_spec(like.mesh, std::move(placements), std::move(shape), dtype));
}

}  // namespace

// `validate`: check the targets' range (forward; its backward sees the same
// targets, and each check is a host sync on an accelerator).
std::optional<NllCall> nll_call(c10::ArrayRef<c10::IValue> args, size_t self, size_t target, size_t weight,
                               size_t ignore_index, bool validate) {
  auto* impl = maybeGetDTensorImpl(args[self].toTensor());
  if (impl == nullptr) return std::nullopt;
  const DTensorSpec& s = impl->spec();
  const int64_t class_dim = s.ndim() == 1 ? 0 : 1;
  auto cs = classSharding(s, class_dim);
  if (!cs) return std::nullopt;
  NllCall c{impl, class_dim, *cs};
  const at::Tensor& local = impl->local();
  int64_t rows = 1;
  for (int64_t d = 0; d < local.dim(); ++d)
    if (d != class_dim) rows *= local.size(d);
  const int64_t local_classes = local.size(class_dim), num_classes = s.shape[class_dim];
  const int64_t offset = s.local_offset()[class_dim];
  c.lp = local.movedim(class_dim, -1).reshape({rows, local_classes});
  const at::Tensor& t_arg = args[target].toTensor();
  auto* t_impl = maybeGetDTensorImpl(t_arg);
  c.target_shape = t_impl ? t_impl->spec().shape : t_arg.sizes().vec();
  c.target = localAs(t_arg, s.mesh, c.cs.rows);

  const at::Tensor flat = c.target.reshape({-1});
  const at::Tensor valid = flat.ne(args[ignore_index].toInt());
  const at::Tensor t = at::where(valid, flat, at::zeros_like(flat));
  if (validate && t.numel() > 0) {
    const auto [lo, hi] = at::aminmax(t);
    const at::Tensor in_range = lo.ge(0).logical_and_(hi.lt(num_classes));
    // On a GPU, reading the flag would stop the host until the GPU caught
    // up: a device-side assert instead, as ATen's own nll_loss does there.
    if (in_range.is_cuda()) at::_assert_async(in_range);
    else TORCH_CHECK(in_range.item<bool>(), "loss_parallel: target out of range [0, ", num_classes,
                     "): fix the labels or the vocabulary size.");
  }
  c.here = valid & t.ge(offset) & t.lt(offset + local_classes);
  c.index = (t - offset).clamp(0, std::max<int64_t>(local_classes - 1, 0)).unsqueeze(1);
  const Placements replicated(s.placements.size(), Replicate());
  const at::Tensor w = args[weight].isNone() ? at::Tensor() : localAs(args[weight].toTensor(), s.mesh, replicated);
  c.weight = w.defined() ? w.to(c.lp.scalar_type()).index_select(0, t) * valid : valid.to(c.lp.scalar_type());
  return c;
}

// nll_loss_forward on the log-probabilities `logp` [rows, local classes]: the
// loss (per row for reduction none) and the total weight. Per-row losses follow
// the rows; sums are partial over batch-sharded dims.
std::pair<at::Tensor, at::Tensor> nll_forward(const NllCall& c, const at::Tensor& logp, int64_t reduction) {
  const DTensorSpec& s = c.impl->spec();
  at::Tensor picked = logp.size(1) == 0 ? at::zeros({logp.size(0)}, logp.options())
                                        : logp.gather(1, c.index).squeeze(1) * c.here;
  allReduce(s, c.cs.class_dims, picked, ReduceOp::Sum);
  const at::Tensor loss = -picked * c.weight;
  at::Tensor total = c.weight.sum();
  Placements sums = c.cs.rows;
  for (auto& p : sums)
    if (p.is_shard()) p = Partial();
  at::Tensor out;
  Placements out_placements = sums, total_placements = sums;
  std::vector<int64_t> out_shape;
  if (reduction == kNone) {
    out = loss.reshape(c.target.sizes());
    out_placements = c.cs.rows;
    out_shape = c.target_shape;
  } else if (reduction == kSum) {
    out = loss.sum();
  } else {
    allReduce(s, c.cs.batch_dims, total, ReduceOp::Sum);
    total_placements = Placements(s.placements.size(), Replicate());
    out = loss.sum() / total;
  }
  return {wrap(std::move(out), s, out_placements, out_shape), wrap(std::move(total), s, total_placements, {})};
}

// d loss / d (row's loss term) from the output's gradient: per row, weighted.
at::Tensor row_coeff(const NllCall& c, const DeviceMesh& mesh, const at::Tensor& grad_out, const at::Tensor& total,
                    int64_t reduction) {
  const auto dtype = c.weight.scalar_type();
  const Placements replicated(mesh.ndim(), Replicate());
  at::Tensor g = localAs(grad_out, mesh, reduction == kNone ? c.cs.rows : replicated);
  at::Tensor coeff = g.reshape({-1}).to(dtype) * c.weight;
  if (reduction == kMean) coeff.div_(localAs(total, mesh, replicated).to(dtype));
  return coeff;
}

namespace {

// sum(exp(x), dim), an eighth of the rows (dim 0) at a time: the logits sit
// at the step's memory peak, where a logits-sized temporary is one logits'
// worth more peak memory and, with glibc returning the freed top of the heap,
// fresh pages on every step.
at::Tensor rowSumExp(const at::Tensor& x, int64_t dim) {
  if (dim == 0 || x.numel() == 0) return x.exp().sum(dim, /*keepdim=*/true);
  const int64_t n = x.size(0), block = (n + 7) / 8;
  auto shape = x.sizes().vec();
  shape[dim] = 1;
  at::Tensor sum = at::empty(shape, x.options());
  for (int64_t i = 0; i < n; i += block) {
    at::Tensor rows = sum.narrow(0, i, std::min(block, n - i));
    at::sum_out(rows, x.narrow(0, i, rows.size(0)).exp(), dim, /*keepdim=*/true);
  }
  return sum;
}

}  // namespace

// log_softmax of this rank's class columns `x` along `dim` over the whole
// class dim (the mesh dims `class_dims` shard it): 2 all-reduces per dim.
at::Tensor local_log_softmax(const at::Tensor& x, int64_t dim, const DTensorSpec& s,
                           const std::vector<size_t>& class_dims) {
  at::Tensor max;
  if (x.size(dim) == 0) {  // an empty shard (fewer classes than ranks)
    auto shape = x.sizes().vec();
    shape[dim] = 1;
    max = at::full(shape, -std::numeric_limits<double>::infinity(), x.options());
  } else {
    max = std::get<0>(x.max(dim, /*keepdim=*/true)).contiguous();
  }
  allReduce(s, class_dims, max, ReduceOp::Max);
  at::Tensor out = x - max;
  at::Tensor sumexp = rowSumExp(out, dim);
  allReduce(s, class_dims, sumexp, ReduceOp::Sum);
  return out.sub_(sumexp.log_());
}

namespace {

bool logSoftmax(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  auto args = torch::jit::last(*stack, 3);
  if (!loss_parallel_on) return false;
  const at::Tensor self = args[0].toTensor();
  auto* impl = maybeGetDTensorImpl(self);
  if (impl == nullptr) return false;
  const int64_t dim = c10::maybe_wrap_dim(args[1].toInt(), self.dim());
  checkShardedOnClassDim(impl->spec(), dim);
  auto cs = classSharding(impl->spec(), dim);
  if (!cs) return false;
  const bool half_to_float = args[2].toBool();
  const DTensorSpec& s = impl->spec();
  at::Tensor out = local_log_softmax(half_to_float ? impl->local().to(at::kFloat) : impl->local(), dim, s, cs->class_dims);
  torch::jit::drop(*stack, 3);
  stack->emplace_back(wrap(std::move(out), s, s.placements, s.shape));
  return true;
}

bool logSoftmaxBackward(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  auto args = torch::jit::last(*stack, 4);
  const at::Tensor grad = args[0].toTensor(), output = args[1].toTensor();
  auto* out_impl = maybeGetDTensorImpl(output);
  if (out_impl == nullptr) return false;
  const DTensorSpec& s = out_impl->spec();
  const int64_t dim = c10::maybe_wrap_dim(args[2].toInt(), output.dim());
  auto cs = classSharding(s, dim);
  if (!cs) return false;
  const auto input_dtype = static_cast<at::ScalarType>(args[3].toInt());
  at::Tensor g = localAs(grad, s.mesh, s.placements);
  // NOTE: [nll_loss gradient's row sums]
  auto* grad_impl = maybeGetDTensorImpl(grad);
  at::Tensor rowsum = grad_impl != nullptr && grad_impl->spec().placements == s.placements
                          ? knownRowSums(grad_impl->spec(), g, dim)
                          : at::Tensor();
  if (!rowsum.defined()) {
    rowsum = g.sum(dim, /*keepdim=*/true);
    allReduce(s, cs->class_dims, rowsum, ReduceOp::Sum);
  }
  at::Tensor grad_in = out_impl->local().exp().mul_(rowsum.neg()).add_(g).to(input_dtype);
  torch::jit::drop(*stack, 4);
  stack->emplace_back(wrap(std::move(grad_in), s, s.placements, s.shape));
  return true;
}

bool nllLossForward(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  auto args = torch::jit::last(*stack, 5);
  if (!loss_parallel_on) return false;
  auto c = nll_call(args, /*self=*/0, /*target=*/1, /*weight=*/2, /*ignore_index=*/4, /*validate=*/true);
  if (!c) return false;
  auto [out, total] = nll_forward(*c, c->lp, args[3].toInt());
  torch::jit::drop(*stack, 5);
  stack->emplace_back(std::move(out));
  stack->emplace_back(std::move(total));
  return true;
}

bool nllLossBackward(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  auto args = torch::jit::last(*stack, 7);
  auto c = nll_call(args, /*self=*/1, /*target=*/2, /*weight=*/3, /*ignore_index=*/5, /*validate=*/false);
  if (!c) return false;
  const DTensorSpec& s = c->impl->spec();
  const at::Tensor& lp = c->lp;
  at::Tensor coeff = row_coeff(*c, s.mesh, args[0].toTensor(), args[6].toTensor(), args[4].toInt()).neg_();
  at::Tensor grad = at::zeros_like(lp);
  if (lp.size(1) > 0) grad.scatter_(1, c->index, (coeff * c->here).unsqueeze(1));
  grad = grad.reshape(c->impl->local().movedim(c->class_dim, -1).sizes()).movedim(-1, c->class_dim);
  auto facts = rowSumFacts(grad, c->class_dim, std::move(coeff));
  torch::jit::drop(*stack, 7);
  stack->emplace_back(makeDTensor(grad, with_facts(make_spec(s.mesh, s.placements, s.shape, grad.scalar_type()),
                                                   std::move(facts))));
  return true;
}

}  // namespace

bool loss_parallel_enabled() { return loss_parallel_on; }
void set_loss_parallel_enabled(bool on) { loss_parallel_on = on; }

void register_loss_parallel_handlers() {
  static std::once_flag once;
  std::call_once(once, [] {
    auto& r = RuleRegistry::get();
    r.add_technique_handler("aten::_log_softmax", logSoftmax);
    r.add_technique_handler("aten::_log_softmax_backward_data", logSoftmaxBackward);
    for (const char* op : {"aten::nll_loss_forward", "aten::nll_loss2d_forward"})
      r.add_technique_handler(op, nllLossForward);
    for (const char* op : {"aten::nll_loss_backward", "aten::nll_loss2d_backward"})
      r.add_technique_handler(op, nllLossBackward);
  });
}

}  // namespace dtp::detail
