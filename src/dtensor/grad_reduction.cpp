// keep_grad_placements: parameter gradients arrive with the parameter's own
// placements, with the Partial -> Replicate reductions of one backward
// bucketed into one all-reduce.
#include "dtp/dtensor.h"

#include "dtensor/dtensor_impl.h"
#include "dtensor/grad_reduction.h"
#include "dtensor/redistribute.h"
#include "dtp/comm_counter.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <atomic>

namespace dtp {
namespace {

using detail::ExecInfo;

// NOTE: [Bucketed gradient reduction]
// A replicated parameter that meets sharded activations (a norm weight under
// sequence parallelism, a bias after a Shard(0) input) gets a Partial(sum)
// gradient. Reducing each one as it arrives costs one all-reduce per
// parameter; Megatron coalesces them. So, as DDP does:
// - the parameter's tensor hook returns a private copy of this rank's partial
//   gradient, labelled with the parameter's placements, and files it in the
//   bucket of its process group for the running backward (its GraphTask);
// - the hook notes whether AccumulateGrad will add it to .grad: always for
//   backward(), only for `inputs` of torch::autograd::grad in 2.x, which
//   runs tensor hooks before it captures a gradient;
// - at the end of backward (Engine::queue_callback) each bucket all-reduces
//   its partials, one all-reduce per dtype in parameter creation order, and
//   adds (sum - partial) to the tensor the hook returned (what
//   torch::autograd::grad captured, or .grad itself when AccumulateGrad
//   adopted it) and, when AccumulateGrad added it into an existing .grad
//   (libtorch 1.13's zero_grad keeps zero gradients) or copied it, to .grad.
// Reduction stays immediate under create_graph (the gradient must stay
// differentiable) and for transitions other than one mesh dimension
// P(sum) -> R. Hooks registered on the parameter after this one see the
// unreduced partial, as with DDP.

// Buckets filed from nested backwards, per enclosing backward.
std::vector<std::shared_ptr<class GradBucket>>& outerBuckets();

using WeakTensorImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

struct PendingGrad {
  uint64_t order;      // the parameter's creation order: the same on every rank
  WeakTensorImpl param;
  bool accumulates;    // AccumulateGrad adds the gradient to param.grad()
  at::Tensor partial;  // the local shard of the gradient the hook returned
};

class GradBucket {
 public:
  GradBucket(const ExecInfo* task, ProcessGroup group) : task_(task), group_(std::move(group)) {}
  bool serves(const ExecInfo* task, const ProcessGroup& group) const {
    return open_ && task_ == task && group_ == group;
  }
  void add(PendingGrad p) { pending_.push_back(std::move(p)); }

  void flush() {
    open_ = false;
    at::NoGradGuard no_grad;
    // CommCounter files these under their own name, not the last module.
    static const std::string kLabel = "(gradient reduction)";
    const CommModuleScope scope(&kLabel);
    std::stable_sort(pending_.begin(), pending_.end(),
                     [](const PendingGrad& a, const PendingGrad& b) { return a.order < b.order; });
    std::vector<bool> done(pending_.size(), false);
    for (size_t i = 0; i < pending_.size(); ++i) {
      if (done[i]) continue;
      std::vector<PendingGrad*> same;
      std::vector<at::Tensor> flat;
      for (size_t j = i; j < pending_.size(); ++j) {
        if (done[j] || pending_[j].partial.scalar_type() != pending_[i].partial.scalar_type()) continue;
        done[j] = true;
        same.push_back(&pending_[j]);
        flat.push_back(pending_[j].partial.reshape(-1));
      }
      at::Tensor partial = at::cat(flat);
      at::Tensor delta = partial.clone();
      group_.all_reduce(delta).wait();
      delta.sub_(partial);
      int64_t offset = 0;
      for (PendingGrad* p : same) {
        at::Tensor d = delta.narrow(0, offset, p->partial.numel()).view(p->partial.sizes());
        offset += p->partial.numel();
        p->partial.add_(d);
        if (p->accumulates) addToGrad(*p, d);
      }
    }
    pending_.clear();
  }

 private:
  static void addToGrad(const PendingGrad& p, const at::Tensor& d) {
    const at::Tensor param(p.param.lock());
    if (!param.defined()) return;
    const at::Tensor grad = param.grad();
    auto* gi = maybeGetDTensorImpl(grad);
    TORCH_INTERNAL_ASSERT(gi != nullptr, "keep_grad_placements: .grad of a DTensor parameter is ",
                          grad.defined() ? "a plain tensor" : "undefined", " after AccumulateGrad");
    if (!gi->local().is_alias_of(p.partial)) gi->local().add_(d);
  }

  const ExecInfo* task_;
  ProcessGroup group_;
  std::vector<PendingGrad> pending_;
  bool open_ = true;
};

// NOTE: [Buckets of a nested backward] checkpoint's recomputation runs a
// backward inside backward. Its partial gradients belong to the enclosing
// backward's buckets: an OuterBackwardScope, made in the enclosing backward
// before the nested one starts, queues one callback there that flushes that
// backward's buckets, and makes the nested backward file into them.
thread_local const ExecInfo* outer_task = nullptr;

// The bucket of `group` for the running backward. The backward's final
// callback owns it, so a backward that throws drops its bucket.
std::shared_ptr<GradBucket> bucketFor(const ExecInfo* task, const ProcessGroup& group) {
  thread_local std::vector<std::weak_ptr<GradBucket>> buckets;
  std::shared_ptr<GradBucket> found;
  buckets.erase(std::remove_if(buckets.begin(), buckets.end(),
                               [&](const auto& w) {
                                 auto b = w.lock();
                                 if (b && b->serves(task, group)) found = b;
                                 return !b;
                               }),
                buckets.end());
  if (found) return found;
  auto b = std::make_shared<GradBucket>(task, group);
  if (task == outer_task) outerBuckets().push_back(b);  // flushed by the enclosing backward's callback
  else torch::autograd::Engine::get_default_engine().queue_callback([b] { b->flush(); });
  buckets.push_back(b);
  return b;
}

// The mesh dimension whose P(sum) -> R reduction can be bucketed, or -1.
int64_t bucketableDim(const Placements& grad, const Placements& param) {
  int64_t dim = -1;
  for (size_t m = 0; m < grad.size(); ++m) {
    if (grad[m] == param[m]) continue;
    if (dim >= 0 || !param[m].is_replicate() || !grad[m].is_partial() || grad[m].op != ReduceOp::Sum)
      return -1;
    dim = static_cast<int64_t>(m);
  }
  return dim;
}

// This rank's partial, filed for the end of backward; returns its copy.
at::Tensor deferReduction(const SpecPtr& spec, uint64_t order, const WeakTensorImpl& weak_param,
                          const DTensorImpl& g, int64_t mesh_dim) {
  const ExecInfo* task = torch::autograd::get_current_graph_task_exec_info();
  TORCH_INTERNAL_ASSERT(task != nullptr, "keep_grad_placements: gradient hook ran outside backward");
  const bool accumulates = detail::accumulates_grad(*task, at::Tensor(weak_param.lock()));
  const ExecInfo* bucket_task = outer_task != nullptr ? outer_task : task;
  at::Tensor partial = g.local().clone(at::MemoryFormat::Contiguous);
  bucketFor(bucket_task, spec->mesh.get_group(mesh_dim))->add({order, weak_param, accumulates, partial});
  return partial;
}

std::vector<std::shared_ptr<GradBucket>>& outerBuckets() {
  thread_local std::vector<std::shared_ptr<GradBucket>> b;
  return b;
}

}  // namespace

detail::OuterBackwardScope::OuterBackwardScope() : prev_(outer_task) {
  const ExecInfo* task = torch::autograd::get_current_graph_task_exec_info();
  TORCH_INTERNAL_ASSERT(task != nullptr, "OuterBackwardScope outside a backward");
  if (outer_task != task && prev_ == nullptr) {
    thread_local const ExecInfo* flushed_by_callback = nullptr;
    if (flushed_by_callback != task) {
      flushed_by_callback = task;
      torch::autograd::Engine::get_default_engine().queue_callback([] {
        auto pending = std::move(outerBuckets());
        outerBuckets().clear();
        for (auto& b : pending) b->flush();
        flushed_by_callback = nullptr;
      });
    }
    outer_task = task;
  }
}

detail::OuterBackwardScope::~OuterBackwardScope() { outer_task = prev_; }

void keep_grad_placements(const at::Tensor& param) {
  const DTensorImpl& impl = checkedDTensorImpl(param, "keep_grad_placements");
  static std::atomic<uint64_t> next_order{0};
  const uint64_t order = next_order++;
  const WeakTensorImpl weak_param(param.getIntrusivePtr());
  param.register_hook([spec = impl.spec_ptr(), order, weak_param](const at::Tensor& g) -> at::Tensor {
    auto* gi = maybeGetDTensorImpl(g);
    if (gi == nullptr) return g;
    // AccumulateGrad then copies a gradient laid out unlike its parameter
    // into the parameter's layout (NOTE: [DTensor strides]).
    if (gi->spec().placements == spec->placements) return g;
    // create_graph: the returned gradient keeps its history (libtorch 2.x
    // hands what this hook returns to torch::autograd::grad's caller).
    if (at::GradMode::is_enabled() && g.requires_grad()) return redistribute(g, spec->mesh, spec->placements);
    const int64_t dim = bucketableDim(gi->spec().placements, spec->placements);
    const at::Tensor local = dim >= 0 && spec->mesh.size(dim) > 1 && !at::GradMode::is_enabled()
                                 ? deferReduction(spec, order, weak_param, *gi, dim)
                                 : redistribute_local(gi->local(), gi->spec(), spec->placements);
    return makeDTensor(local, make_spec(spec->mesh, spec->placements, spec->shape, gi->spec().dtype));
  });
}

bool detail::accumulates_grad(const detail::ExecInfo& task, const at::Tensor& param) {
  if (task.empty()) return true;
  auto acc = torch::autograd::impl::try_get_grad_accumulator(param);
  auto it = acc ? task.find(acc.get()) : task.end();
  return it != task.end() && it->second.needed_;
}

}  // namespace dtp
