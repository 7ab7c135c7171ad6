// View and shape ops as dim-maps: input dim d sharded -> output dim map[d]
// sharded, or -1 when the op mixes that dim (then the input is gathered).
// Partial passes through: every such op is linear.
#include "dtensor/rules/common.h"

#include "dtensor/dtensor_impl.h"

#include <ATen/ATen.h>

#include <algorithm>

namespace dtp {
namespace {

int64_t wrapDim(int64_t d, int64_t ndim) { return d < 0 ? d + ndim : d; }

// Input dims of an op that inserts a new dim at argument `arg` of the output
// (unsqueeze, stack, select_backward): dims from there on move up by one.
std::function<std::vector<int64_t>(const OpCall&)> insertsDimAt(size_t arg) {
  return [arg](const OpCall& c) {
    const int64_t nd = c.spec(0).ndim();
    const int64_t at = wrapDim(c.arg_int(arg), nd + 1);
    std::vector<int64_t> map;
    for (int64_t d = 0; d < nd; ++d) map.push_back(d >= at ? d + 1 : d);
    return map;
  };
}

std::vector<Row> dimMapRows(const OpCall& call, int64_t m, const std::vector<int64_t>& map) {
  std::vector<Row> rows{rules::replicate_row(call)};
  const size_t n = call.specs.size();
  for (size_t d = 0; d < map.size(); ++d) {
    if (map[d] < 0) continue;
    rows.push_back(Row{Placements(n, Shard(static_cast<int64_t>(d))),
                       Placements(call.num_outputs, Shard(map[d]))});
  }
  const Placement p = rules::linear_partial(call, m);
  rows.push_back(Row{Placements(n, p), Placements(call.num_outputs, p)});
  return rows;
}

StrategyFn dimMap(std::function<std::vector<int64_t>(const OpCall&)> fn) {
  return [fn](const OpCall& call, int64_t m) { return dimMapRows(call, m, fn(call)); };
}

// view/reshape: dims are grouped where the products of sizes agree
// ([4,6] -> [2,2,6]: {0}->{0,1}, {1}->{2}). A shard survives on the first dim
// of a group when the group is 1:1, or when both first dims divide evenly
// into the pieces the dim may be cut into (rules::shardCount; else chunk
// boundaries would move: f32[5,2] S(0) on 2 ranks is rows 3,2 = 6,4
// elements, but chunking the 10 flat elements gives 5,5).
std::vector<Row> viewRows(const OpCall& call, int64_t m) {
  const auto& a = call.spec(0).shape;
  const auto& b = call.out_shapes[0];
  std::vector<int64_t> map(a.size(), -1);
  size_t i = 0, j = 0;
  while (i < a.size() || j < b.size()) {
    const size_t i0 = i, j0 = j;
    int64_t pa = 1, pb = 1;
    if (i < a.size()) pa *= a[i++];
    if (j < b.size()) pb *= b[j++];
    while (pa != pb && (i < a.size() || j < b.size())) {
      if ((pa < pb && i < a.size()) || j >= b.size()) pa *= a[i++];
      else pb *= b[j++];
    }
    // Size-1 dims carry no data: the group's first dims are its first non-1
    // ones ([1,8] -> [8] keeps S(1) as S(0)).
    size_t fi = i0, fj = j0;
    while (fi < i && a[fi] == 1) ++fi;
    while (fj < j && b[fj] == 1) ++fj;
    if (fi < i && fj < j) {
      auto nonOne = [](const std::vector<int64_t>& s, size_t from, size_t to) {
        return std::count_if(s.begin() + from, s.begin() + to, [](int64_t x) { return x != 1; });
      };
      const bool one_to_one = nonOne(a, i0, i) == 1 && nonOne(b, j0, j) == 1;
      const int64_t w = rules::shardCount(call, 0, static_cast<int64_t>(fi), m);
      if (one_to_one || (a[fi] % w == 0 && b[fj] % w == 0)) map[fi] = static_cast<int64_t>(fj);
    } else if (i - i0 == 1 && j - j0 == 1) {
      map[i0] = static_cast<int64_t>(j0);  // a lone size-1 dim to a lone one: see below
    }
  }
  // A shard of a size-1 dim is the whole tensor on the first rank and nothing
  // on the others (f64[6,1,4](S(1)) on 2 ranks -> local sizes 1,0 of dim 1),
  // as a shard of any size-1 dim is: it stays, on the output's size-1 dim
  // in its place or else the first one ([6,1,4] -> [6,1,1,4] as nll_loss_nd
  // views 3-D logits; [1,1] -> [1] as sum_to views a bias's gradient),
  // instead of being gathered.
  const auto first_one = std::find(b.begin(), b.end(), 1);
  for (size_t d = 0; d < a.size(); ++d)
    if (a[d] == 1 && map[d] < 0 && first_one != b.end()) map[d] = first_one - b.begin();
  return dimMapRows(call, m, map);
}

// Also squeeze's: it drops the dims of size 1 in the global shape, never a
// shard's dim that happens to hold one row (f64[5,1,7](S(0)) on 4 ranks:
// local rows 2,2,1,0, and squeeze() on the third shard would drop two dims).
void runReshapeLocal(const c10::OperatorHandle& op, torch::jit::Stack* stack, const Decision& d) {
  const size_t nargs = op.schema().arguments().size();
  at::Tensor x = (*stack)[stack->size() - nargs].toTensor();
  torch::jit::drop(*stack, nargs);
  const auto& sizes = d.out[0]->local_sizes;
  stack->emplace_back(x.is_contiguous() ? x.view(sizes) : x.reshape(sizes));
}

void runExpandLocal(const c10::OperatorHandle& op, torch::jit::Stack* stack, const Decision& d) {
  const size_t nargs = op.schema().arguments().size();
  at::Tensor x = (*stack)[stack->size() - nargs].toTensor();
  torch::jit::drop(*stack, nargs);
  stack->emplace_back(x.expand(d.out[0]->local_sizes));
}

// Backward ops of views take the input's global sizes; locally they need the
// shard's sizes (argument 1 of slice_backward and select_backward).
void runWithLocalInputSizes(const c10::OperatorHandle& op, torch::jit::Stack* stack,
                            const Decision& d) {
  const size_t nargs = op.schema().arguments().size();
  (*stack)[stack->size() - nargs + 1] = c10::IValue(d.out[0]->local_sizes);
  op.callBoxed(stack);
}

// In-place view ops (squeeze_, unsqueeze_, t_, transpose_; matmul of a
// vector by a matrix ends in squeeze_): the out-of-place op gives the new
// view as a DTensor, and the argument takes over its shard and spec, keeping
// its identity (the TensorImpl autograd and the caller hold).
template <const char* kName, const char* kOverload>
bool inPlaceView(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  static const c10::OperatorHandle out_of_place = c10::Dispatcher::singleton().findSchemaOrThrow(kName, kOverload);
  const size_t nargs = op.schema().arguments().size();
  const at::Tensor self = (*stack)[stack->size() - nargs].toTensor();
  DTensorImpl* impl = maybeGetDTensorImpl(self);
  if (impl == nullptr) return false;
  out_of_place.callBoxed(stack);
  const at::Tensor view = torch::jit::pop(*stack).toTensor();
  const DTensorImpl* v = unsafeGetDTensorImpl(view);
  // A view that had to move data (its dim was sharded) would no longer alias
  // the tensor's base: on one device it would. (The message is built only on
  // failure; the tensor's spec is still the one it came with.)
  TORCH_CHECK(v->local().is_alias_of(impl->local()), "dtp: ", op.schema().name(), " on a DTensor placed ",
              to_string(impl->spec().placements),
              " would move its data (the dim it changes is sharded), and an in-place view must stay a view of its "
              "base. Redistribute it first, or use the out-of-place ", kName, ".");
  impl->set(v->local(), v->spec_ptr());
  stack->emplace_back(self);
  return true;
}
constexpr char kSqueeze[] = "aten::squeeze", kUnsqueeze[] = "aten::unsqueeze", kT[] = "aten::t",
               kTranspose[] = "aten::transpose", kNone[] = "", kDim[] = "dim", kInt[] = "int";

}  // namespace

void registerViewRules(RuleRegistry& r) {
  r.add_handler("aten::squeeze_.dim", inPlaceView<kSqueeze, kDim>);
  r.add_handler("aten::squeeze_", inPlaceView<kSqueeze, kNone>);
  r.add_handler("aten::unsqueeze_", inPlaceView<kUnsqueeze, kNone>);
  r.add_handler("aten::t_", inPlaceView<kT, kNone>);
  r.add_handler("aten::transpose_", inPlaceView<kTranspose, kInt>);
  for (const char* op : {"aten::view", "aten::_unsafe_view", "aten::_reshape_alias"})
    r.add(op, viewRows, nullptr, runReshapeLocal);
  r.add("aten::expand", dimMap([](const OpCall& c) {
    const auto& a = c.spec(0).shape;
    const auto& b = c.out_shapes[0];
    const int64_t off = static_cast<int64_t>(b.size() - a.size());
    std::vector<int64_t> map;
    for (size_t d = 0; d < a.size(); ++d) map.push_back(a[d] == b[d + off] ? d + off : -1);
    return map;
  }), nullptr, runExpandLocal);
  r.add("aten::permute", dimMap([](const OpCall& c) {
    const int64_t nd = c.spec(0).ndim();
    auto dims = c.args[1].toIntVector();
    std::vector<int64_t> map(nd);
    for (int64_t o = 0; o < nd; ++o) map[wrapDim(dims[o], nd)] = o;
    return map;
  }));
  r.add("aten::transpose.int", dimMap([](const OpCall& c) {
    const int64_t nd = c.spec(0).ndim();
    std::vector<int64_t> map(nd);
    for (int64_t d = 0; d < nd; ++d) map[d] = d;
    std::swap(map[wrapDim(c.arg_int(1), nd)], map[wrapDim(c.arg_int(2), nd)]);
    return map;
  }));
  r.add("aten::t", dimMap([](const OpCall& c) {
    return c.spec(0).ndim() == 2 ? std::vector<int64_t>{1, 0} : std::vector<int64_t>{0};
  }));
  r.add("aten::unsqueeze", dimMap(insertsDimAt(1)));
  auto squeezeMap = [](const OpCall& c, std::vector<bool> drop) {
    std::vector<int64_t> map;
    int64_t o = 0;
    for (size_t d = 0; d < drop.size(); ++d) map.push_back(drop[d] ? -1 : o++);
    return map;
  };
  r.add("aten::squeeze.dim", dimMap([squeezeMap](const OpCall& c) {
    const auto& a = c.spec(0).shape;
    std::vector<bool> drop(a.size(), false);
    if (!a.empty()) {
      const int64_t d = wrapDim(c.arg_int(1), static_cast<int64_t>(a.size()));
      drop[d] = a[d] == 1;
    }
    return squeezeMap(c, drop);
  }), nullptr, runReshapeLocal);
  r.add("aten::squeeze", dimMap([squeezeMap](const OpCall& c) {
    std::vector<bool> drop;
    for (int64_t s : c.spec(0).shape) drop.push_back(s == 1);
    return squeezeMap(c, drop);
  }), nullptr, runReshapeLocal);
  // Ops indexing along `dim` keep shards on the other dims only.
  auto exceptDim = [](int64_t dim_arg, bool removes_dim) {
    return dimMap([=](const OpCall& c) {
      const int64_t nd = c.spec(0).ndim();
      const int64_t dim = wrapDim(c.arg_int(dim_arg), nd);
      std::vector<int64_t> map;
      for (int64_t d = 0; d < nd; ++d)
        map.push_back(d == dim ? -1 : (removes_dim && d > dim ? d - 1 : d));
      return map;
    });
  };
  r.add("aten::slice.Tensor", exceptDim(1, false));
  r.add("aten::select.int", exceptDim(1, true));
  r.add("aten::split.Tensor", exceptDim(2, false));
  r.add("aten::split_with_sizes", exceptDim(2, false));
  r.add("aten::unbind.int", exceptDim(1, true));
  r.add("aten::slice_backward", exceptDim(2, false), nullptr, runWithLocalInputSizes);
  r.add("aten::select_backward", dimMap(insertsDimAt(2)), nullptr, runWithLocalInputSizes);
  r.add("aten::stack", dimMap(insertsDimAt(1)));
  r.add("aten::cat", dimMap([](const OpCall& c) {
    const int64_t nd = c.spec(0).ndim();
    const int64_t dim = wrapDim(c.arg_int(1), nd);
    std::vector<int64_t> map;
    for (int64_t d = 0; d < nd; ++d) map.push_back(d == dim ? -1 : d);
    return map;
  }));
}

}  // namespace dtp
