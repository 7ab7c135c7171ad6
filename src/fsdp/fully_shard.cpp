// fully_shard: FSDP2-style units of dim-0 sharded parameters over "dp".
#include "dtp/fsdp/fully_shard.h"

#include "dtensor/dtensor_impl.h"
#include "dtensor/mix_hint.h"
#include "dtensor/redistribute.h"
#include "dtp/dtensor.h"
#include "dtp/module_utils.h"
#include "dtp/nn/hooked.h"
#include "comm/result_tape.h"
#include "dtensor/random_state.h"
#include "dtensor/rules_agree.h"
#include "fsdp/data_parallel.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <numeric>

namespace dtp {
namespace {

using torch::autograd::variable_list;

constexpr const char* kApplied = detail::technique::kFullyShard;

// One parameter of a unit.
struct ShardedParam {
  std::vector<std::pair<torch::nn::Module*, std::string>> fields;  // where forward reads it (tied: several)
  std::string fqn;
  at::Tensor sharded;                 // the registered leaf: DTensor [tp placement, (R,) S(0)] on (tp, (dp_replicate,) dp)
  SpecPtr tp_spec;                    // what forward sees: this TP DTensor (in param_dtype), or (null) a plain tensor
  std::vector<int64_t> local_shape;   // the TP shard (gathered over dp)
  std::vector<int64_t> rows;          // its rows on each dp rank (torch.chunk)
  int64_t inner = 1;                  // elements per row

  int64_t row_start(int r) const {
    int64_t s = 0;
    for (int q = 0; q < r; ++q) s += rows[q];
    return s;
  }
};

class Unit;

// One forward's gathered TP shards, one per parameter; their memory is freed
// when resharded. NOTE: [Gathered per forward]
using Gathered = std::vector<at::Tensor>;

// NOTE: [Unit gather backward] The gathered TP shards of a unit are outputs
// of one autograd node whose inputs are the sharded parameters' locals: the
// engine runs it once, after every op of the unit has produced its
// gradients, and it reduce-scatters all of them in one collective.
struct UnitGatherBackward : torch::autograd::Node {
  std::weak_ptr<Unit> unit;
  std::weak_ptr<Gathered> gathered;  // kept alive by the hook on the unit's output
  std::string name() const override { return "dtp::FullyShardGatherBackward"; }
  variable_list apply(variable_list&& grads) override;
};

// NOTE: [Reshard after forward] Autograd keeps the gathered parameters that
// ops saved for backward. Freeing them means releasing their storage's memory
// while the tensors stay (every alias shares the StorageImpl); gathering
// again puts new memory of the same size under the same StorageImpl, so
// what autograd saved reads the gathered values, without a version bump.
//
// NOTE: [Prefetch] The first forward records the order units run in. From
// then on a unit's forward starts the next unit's all-gather without waiting
// for it, and a unit's regather in backward starts the previous unit's, so
// communication overlaps compute. A prefetch is used only if the shards have
// not changed since (their version counters, which an optimizer step bumps);
// otherwise it is waited for and dropped, alike on every rank.
//
// NOTE: [Gathered per forward] Each forward gathers into tensors of its own,
// which its backward node regathers and frees: with pipeline microbatches,
// forwards of later microbatches run before the backward of earlier ones,
// and each backward must find the parameters its own forward saved.
class Unit : public std::enable_shared_from_this<Unit> {
 public:
  ProcessGroup dp;                        // where the parameters are sharded
  std::optional<ProcessGroup> replicate;  // HSDP: where the shards are replicated
  ProcessGroup batch;                     // every data-parallel rank
  FullyShardOptions options;
  std::vector<ShardedParam> params;
  std::vector<int64_t> flat_sizes;  // elements each dp rank contributes
  std::optional<DeviceMesh> tp;     // "tp" of the mesh, when 2-D
  std::optional<bool> root;         // decided by the first forward
  std::weak_ptr<Unit> next_in_forward, next_in_backward;  // NOTE: [Prefetch]
  bool order_known = false;
  // NOTE: [Mix hints]: this unit's (when it replicates plain parameters over
  // tp) and the one it replaced while its forward runs.
  std::shared_ptr<const std::string> mix_hint, outer_hint;

  static bool freed(const Gathered* g) { return g != nullptr && !g->empty() && (*g)[0].storage().nbytes() == 0; }
  bool freed() const { return freed(gathered_.get()); }
  const std::shared_ptr<Gathered>& gathered() const { return gathered_; }

  // Starts gathering this unit (unless started), for use by its next unshard.
  void prefetch() {
    if (!prefetched_) prefetched_ = Prefetch{startGather(), versions()};
  }

  // Forward pre-hook: gathers every parameter (one all-gather), connected to
  // autograd, and points the modules' fields at the gathered tensors.
  void unshard() {
    std::vector<at::Tensor> locals;
    bool needs_grad = false;
    for (auto& p : params) {
      locals.push_back(to_local(p.sharded));
      needs_grad = needs_grad || locals.back().requires_grad();
    }
    gathered_ = std::make_shared<Gathered>(takeGather());
    const Gathered& gathered = *gathered_;
    std::vector<at::Tensor> values;
    for (size_t i = 0; i < params.size(); ++i)
      values.push_back(params[i].tp_spec ? makeDTensor(gathered[i], params[i].tp_spec) : gathered[i]);
    if (needs_grad && at::GradMode::is_enabled()) {
      auto node = std::make_shared<UnitGatherBackward>();
      node->unit = weak_from_this();
      node->gathered = gathered_;
      node->set_next_edges(torch::autograd::collect_next_edges(locals));
      torch::autograd::set_history(values, node);
    }
    for (size_t i = 0; i < params.size(); ++i)
      for (auto& [module, field] : params[i].fields) set_parameter_field(*module, field, values[i]);
  }

  // Frees one forward's gathered parameters; the modules' fields show the
  // sharded ones again (as FSDP2's registered parameters), never freed memory.
  void reshard(Gathered* g) {
    if (g == nullptr) return;
    for (size_t i = 0; i < params.size(); ++i) {
      auto* storage = (*g)[i].storage().unsafeGetStorageImpl();
      storage->set_data_ptr_noswap(at::DataPtr(nullptr, (*g)[i].device()));
      storage->set_nbytes(0);
      for (auto& [module, field] : params[i].fields) set_parameter_field(*module, field, params[i].sharded);
    }
  }

  // Before backward reaches the unit: the freed parameters again; then the
  // unit backward reaches next starts gathering.
  void regather_if_freed(Gathered& g) {
    if (!freed(&g)) return;
    at::NoGradGuard no_grad;
    auto fresh = takeGather();
    for (size_t i = 0; i < params.size(); ++i) {
      auto* into = g[i].storage().unsafeGetStorageImpl();
      auto* from = fresh[i].storage().unsafeGetStorageImpl();
      into->set_nbytes(from->nbytes());
      into->set_data_ptr_noswap(from->set_data_ptr(at::DataPtr(nullptr, fresh[i].device())));
    }
    if (auto prev = next_in_backward.lock())
      if (prev->freed()) prev->prefetch();
  }

  // NOTE: [Partial gradients under fully_shard] As NOTE: [Partial gradients
  // under data parallelism]: the unit reduce-scatters the partial sums over
  // dp first and then all-reduces over tp only this rank's shard of all such
  // gradients together: one all-reduce per unit, on 1/dp of the bytes.
  variable_list reduce_scatter(variable_list& grads, Gathered* g) {
    const int W = dp.size();
    std::vector<at::Tensor> locals;
    std::vector<bool> partial(params.size(), false);
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& p = params[i];
      if (!grads[i].defined()) {
        locals.push_back(at::zeros(p.local_shape, unsafeGetDTensorImpl(p.sharded)->local().options().dtype(reduceDtype(p))));
        continue;
      }
      const detail::LocalGrad lg = detail::local_grad(grads[i], p.tp_spec.get());
      partial[i] = lg.partial;
      locals.push_back(lg.local.to(reduceDtype(p)));
    }
    std::vector<at::Tensor> pieces;
    for (int r = 0; r < W; ++r) {
      for (size_t i = 0; i < params.size(); ++i) {
        const auto& p = params[i];
        pieces.push_back(locals[i].narrow(0, p.row_start(r), p.rows[r]).reshape({-1}));
      }
    }
    const auto& factor = options.gradient_divide_factor;
    const ReduceOp op = factor ? ReduceOp::Sum : ReduceOp::Avg;
    at::Tensor mine = dp.reduce_scatter(at::cat(pieces), 0, flat_sizes, op).wait();
    if (replicate) replicate->all_reduce(mine, op).wait();  // HSDP: the shard's replicas
    if (factor) mine.div_(*factor);
    variable_list out;
    int64_t offset = 0;
    const int me = dp.rank();
    for (const auto& p : params) {
      auto shape = p.local_shape;
      shape[0] = p.rows[me];
      out.push_back(mine.narrow(0, offset, p.rows[me] * p.inner).view(shape).to(p.sharded.scalar_type()));
      offset += p.rows[me] * p.inner;
    }
    std::vector<at::Tensor> sums;
    for (size_t i = 0; i < params.size(); ++i)
      if (partial[i]) sums.push_back(out[i].to(reduceDtype(params[i])));
    if (!sums.empty()) {
      const std::vector<at::Tensor> summed = detail::sum_over_tp(sums, tpGroup());
      size_t k = 0;
      for (size_t i = 0; i < params.size(); ++i)
        if (partial[i]) out[i] = summed[k++].to(params[i].sharded.scalar_type());
    }
    reshard(g);
    return out;
  }

 private:
  ProcessGroup tpGroup() const {
    TORCH_INTERNAL_ASSERT(tp.has_value(), "fully_shard: a Partial gradient without a tp mesh");
    return tp->get_group(0);
  }

  c10::ScalarType paramDtype(const ShardedParam& p) const {
    return options.mp_policy.param_dtype.value_or(p.sharded.scalar_type());
  }

  c10::ScalarType reduceDtype(const ShardedParam& p) const {
    return options.mp_policy.reduce_dtype.value_or(paramDtype(p));
  }

  std::vector<int64_t> versions() const {
    std::vector<int64_t> v;
    for (const auto& p : params) v.push_back(static_cast<int64_t>(p.sharded._version()));
    return v;
  }

  // One all-gather of every parameter's shard (in param_dtype), flattened
  // together, not waited for.
  Work startGather() const {
    detail::TapeBypass bypass;  // gathered parameters are not kept by selective checkpointing
    std::vector<at::Tensor> flat;
    for (const auto& p : params) flat.push_back(unsafeGetDTensorImpl(p.sharded)->local().to(paramDtype(p)).reshape({-1}));
    return dp.all_gather(at::cat(flat), 0, flat_sizes, /*async_op=*/true);
  }

  // Each parameter's TP shard (fresh, contiguous), from a prefetch that is
  // still current or from a new all-gather.
  std::vector<at::Tensor> takeGather() {
    std::optional<Work> work;
    if (prefetched_) {
      if (prefetched_->versions == versions()) work = std::move(prefetched_->work);
      else prefetched_->work.wait();  // stale: the optimizer stepped since
      prefetched_.reset();
    }
    if (!work) work = startGather();
    at::Tensor all = work->wait();
    std::vector<std::vector<at::Tensor>> per_param(params.size());
    int64_t offset = 0;
    for (int r = 0; r < dp.size(); ++r) {
      for (size_t i = 0; i < params.size(); ++i) {
        const auto& p = params[i];
        auto shape = p.local_shape;
        shape[0] = p.rows[r];
        per_param[i].push_back(all.narrow(0, offset, p.rows[r] * p.inner).view(shape));
        offset += p.rows[r] * p.inner;
      }
    }
    std::vector<at::Tensor> out;
    for (auto& pieces : per_param) out.push_back(at::cat(pieces, 0));
    return out;
  }

  struct Prefetch {
    Work work;
    std::vector<int64_t> versions;
  };
  std::optional<Prefetch> prefetched_;
  std::shared_ptr<Gathered> gathered_;  // the latest forward's
};

variable_list UnitGatherBackward::apply(variable_list&& grads) {
  auto u = unit.lock();
  TORCH_CHECK(u != nullptr, "fully_shard: backward through a unit whose module was destroyed.");
  return u->reduce_scatter(grads, gathered.lock().get());
}

// The unit that runs the outermost forward on this thread (FSDP2's root).
thread_local const Unit* running_root = nullptr;
thread_local std::weak_ptr<Unit> last_unsharded;  // in this forward, for NOTE: [Prefetch]

// Records the forward order once: `unit` runs after the last unit unsharded.
void learnOrder(const std::shared_ptr<Unit>& unit) {
  if (auto last = last_unsharded.lock(); last && last != unit && !last->order_known) {
    last->next_in_forward = unit;
    unit->next_in_backward = last;
    last->order_known = true;
  }
  last_unsharded = unit;
}

ShardedParam shardParam(const at::Tensor& param, const std::string& fqn, const detail::DataParallelMesh& m) {
  ShardedParam p;
  p.fqn = fqn;
  TORCH_CHECK(param.dim() >= 1, "fully_shard: parameter ", fqn, " is a scalar; FSDP shards dim 0. Make it a "
              "1-element vector.");
  at::Tensor local = param.detach();
  if (is_dtensor(param)) {
    const auto& spec = dtensor_spec(param);
    const auto& names = spec.mesh.mesh_dim_names();
    const bool dp_named = std::find_if(names.begin(), names.end(), [](const std::string& n) {
                            return n == "dp" || n == "dp_shard" || n == "dp_replicate";
                          }) != names.end();
    TORCH_CHECK(!dp_named && !(spec.mesh == m.dp_inside_tp),
                "fully_shard: parameter ", fqn, " is already sharded over \"dp\" (", spec.str(), " on ",
                spec.mesh.str(), "). Call fully_shard once per module, and give it the parameters as the TP "
                "plan left them.");
    detail::check_tp_parameter(param, fqn, m, kApplied);
    p.tp_spec = unsafeGetDTensorImpl(param)->spec_ptr();
    local = unsafeGetDTensorImpl(param)->local();
  } else if (m.tp) {
    p.tp_spec = make_spec(*m.tp, {Replicate()}, param.sizes().vec(), param.scalar_type());
  }
  p.local_shape = local.sizes().vec();
  p.rows = chunk_sizes(p.local_shape[0], m.dp.size());
  p.inner = std::accumulate(p.local_shape.begin() + 1, p.local_shape.end(), int64_t{1}, std::multiplies<>());
  const int me = m.dp.rank();
  at::Tensor mine = local.narrow(0, p.row_start(me), p.rows[me]);
  // A meta parameter (deferred init) becomes this rank's shard, not yet
  // initialized (See NOTE: [Deferred initialization] in src/models/llama.cpp).
  mine = mine.is_meta() ? at::empty(mine.sizes(), mine.options().device(m.dp_inside_tp.device())) : mine.clone();
  Placements placements = p.tp_spec ? p.tp_spec->placements : Placements{};
  if (m.replicate) placements.push_back(Replicate());
  placements.push_back(Shard(0));
  p.sharded = from_local(mine, m.dp_inside_tp, placements, /*run_check=*/false, param.sizes().vec()).detach();
  p.sharded.set_requires_grad(param.requires_grad());
  return p;
}

}  // namespace

bool is_fully_sharded(const torch::nn::Module& module) { return detail::was_applied(module, kApplied); }

void fully_shard(torch::nn::Module& module, const DeviceMesh& mesh, FullyShardOptions options) {
  nn::HookHost& host = detail::hooks_of(module, kApplied);
  TORCH_CHECK(!is_fully_sharded(module), "fully_shard: ", module.name(), " is already a fully_shard unit. Call "
              "fully_shard once per module.");
  TORCH_CHECK(detail::applied_below(module, {"replicate"}).empty(), "fully_shard: ", module.name(),
              " (or a module inside it) is already under replicate(). Use one data-parallel technique per module.");
  TORCH_CHECK(detail::applied_below(module, {detail::technique::kMixedPrecision}).empty(), "fully_shard: ",
              module.name(), " (or a module inside it) has apply_mixed_precision, whose copies fully_shard's gathered "
              "parameters would replace. Pass the policy as FullyShardOptions::mp_policy instead.");
  const auto m = detail::data_parallel_mesh(mesh, kApplied);
  check_sharding_rules_agree(mesh, kApplied);  // NOTE: [Ranks agree on sharding rules]
  auto unit = std::make_shared<Unit>();
  unit->dp = m.dp;
  unit->replicate = m.replicate;
  unit->batch = m.batch;
  unit->options = options;
  unit->tp = m.tp;

  auto sites = detail::collect_params(module, kApplied);
  for (auto& site : sites) {
    unit->params.push_back(shardParam(site.param, site.fqn, m));
    auto& p = unit->params.back();
    p.fields = site.fields;
    if (p.tp_spec && options.mp_policy.param_dtype)
      p.tp_spec = make_spec(p.tp_spec->mesh, p.tp_spec->placements, p.tp_spec->shape, *options.mp_policy.param_dtype);
  }
  std::vector<std::string> promoted;  // plain parameters made DTensors over tp
  for (const auto& site : sites)
    if (m.tp && !is_dtensor(site.param)) promoted.push_back(site.fqn);
  if (!promoted.empty()) {
    if (promoted.size() > 3) {
      promoted.resize(3);
      promoted.push_back("...");
    }
    unit->mix_hint = std::make_shared<const std::string>(c10::str(
        "(fully_shard on ", mesh.str(), ": parameters ", c10::Join(", ", promoted), " of this unit are not "
        "DTensors of a TP plan, so fully_shard replicates them over \"tp\" to meet the plan's DTensor "
        "activations, and a plain input cannot meet them. Apply the TP plan first (parallelize_module over "
        "mesh[\"tp\"]), or pass mesh[\"dp\"] when the model has no tensor parallelism.)"));
  }
  // Validate every field before changing anything.
  for (auto& site : sites)
    for (auto& [owner, name] : site.fields) set_parameter_field(*owner, name, site.param);
  for (auto& p : unit->params)
    for (auto& [owner, name] : p.fields) {
      replace_parameter(*owner, name, p.sharded);
      set_parameter_field(*owner, name, p.sharded);
    }
  for (int r = 0; r < m.dp.size(); ++r) {
    int64_t n = 0;
    for (const auto& p : unit->params) n += p.rows[r] * p.inner;
    unit->flat_sizes.push_back(n);
  }

  host.pre_hooks.push_back([unit](std::vector<at::Tensor>& inputs) {
    if (!unit->root) unit->root = running_root == nullptr;
    unit->outer_hint = *unit->root ? nullptr : detail::mix_hint();
    if (unit->mix_hint || *unit->root) detail::mix_hint() = unit->mix_hint;  // NOTE: [Mix hints]
    if (*unit->root) {
      running_root = unit.get();
      last_unsharded.reset();
      detail::set_data_parallel_batch(unit->batch);  // NOTE: [Random ops under data parallelism]
    }
    // NOTE: [fully_shard under checkpoint] The checkpointed first pass runs
    // without grad, so the unit is freed after it; the recomputation in
    // backward gathers again (one all-gather, as backward's regather would)
    // and keeps the parameters for the nested backward, whose reduce-scatter
    // frees them. Meanwhile the unit backward reaches next is prefetched.
    const bool recompute = detail::in_recompute();
    if (!recompute) learnOrder(unit);
    unit->unshard();
    if (recompute) {
      if (auto prev = unit->next_in_backward.lock(); prev && prev->freed()) prev->prefetch();
    } else if (auto next = unit->next_in_forward.lock()) {
      next->prefetch();
    }
    detail::mp_cast_forward_inputs(unit->options.mp_policy, inputs);
  });
  host.post_hooks.push_back([unit](nn::Slots& outputs) {
    detail::mix_hint() = unit->outer_hint;
    if (*unit->root) {
      running_root = nullptr;
      detail::set_data_parallel_batch(ProcessGroup());
    }
    bool backward_comes = false;
    for (const auto& t : outputs) backward_comes |= t.defined() && t.requires_grad();
    if (!backward_comes || !at::GradMode::is_enabled()) {
      unit->reshard(unit->gathered().get());  // no backward will come
      return;
    }
    if (!*unit->root && unit->options.reshard_after_forward && !detail::in_recompute())
      unit->reshard(unit->gathered().get());
    // Whichever output's gradient arrives first regathers (the others find
    // the unit gathered).
    std::weak_ptr<Unit> weak = unit;
    for (auto& t : outputs) {
      if (!t.defined() || !t.requires_grad()) continue;
      t.register_hook([weak, g = unit->gathered()](const at::Tensor& grad) {
        if (auto u = weak.lock()) u->regather_if_freed(*g);
        return grad;
      });
    }
  });
  host.applied.push_back({kApplied, unit});
}

}  // namespace dtp
